"""logprobe on Ray Serve: N model replicas behind one HTTP address (`logprobe serve --replicas N`).

The application has two deployments:

- `ModelReplica` (N of them, or an autoscaled range): each loads the model, runs an `Engine` and holds
  its own capacity (`max_tokens_in_flight`) around it. It speaks the backend seam (backend/): it
  takes `GenerationRequest`s and streams `Delta`s, or for a request answered whole only the end with its
  `GenerationOutput`s, all plain picklable records. Every second it reports its stats and engine metrics to the `ClusterState` actor.
- `Ingress` (one by default): the logprobe HTTP app itself (api/app.py: checks, tokenization, formats,
  errors, keys) on a `RayBackend` (ray_backend.py), which sends each request to a replica through a Serve handle (Serve
  routes it to a replica that has room: `max_ongoing_requests`). Its admission is `SharedAdmission`:
  the token budget is the ClusterState actor's, one for the application.

So the bytes a client gets are made by the same code as in one process; only the engine's work moves.
A replica that dies under a request ends it with 503 (`unavailable`), streams with the error event;
the request's tokens go back to its key's budget, and Serve starts a new replica.

`build_application` makes the application from settings; `from_args` from a dict of flags (`serve run`,
KubeRay); launch.py runs it for `logprobe serve --replicas`.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

import ray
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from ray import serve

from ..api.errors import APIError, InvalidRequest
from ..backend import GenerationRequest, RequestConflict
from ..config import LOG_FORMAT, Settings, build_parser, resolve_models, settings_from_args
from .ray_backend import REPORT_EVERY_S, RayBackend, Refusal
from .state import ClusterState, SharedAdmission

log = logging.getLogger("logprobe.cluster")


def _replica_grpc_on_loopback() -> None:
    """Ray Serve 2.60 starts a gRPC server in every replica for calls between deployments, bound to
    `[::]:0` (every interface) whatever the node's address; in a local cluster (LOGPROBE_RAY_LOOPBACK,
    set by the CLI and inherited by Ray's workers, which import this module before that server starts)
    it is bound to 127.0.0.1 like everything else. Checked by tests/e2e/test_replicas.py."""
    if os.environ.get("LOGPROBE_RAY_LOOPBACK") != "1":
        return
    from ray.serve._private import replica

    bind = replica.add_port_to_grpc_server
    if getattr(bind, "logprobe_loopback", False):
        return

    def on_loopback(server, address: str):
        return bind(server, address.replace("[::]:", "127.0.0.1:", 1))

    on_loopback.logprobe_loopback = True
    replica.add_port_to_grpc_server = on_loopback


_replica_grpc_on_loopback()

NAMESPACE = "logprobe"
STATE_ACTOR = "logprobe-cluster-state"
STATE_CONCURRENCY = 100_000  # the ClusterState actor's calls running at once (Ray's default: 1,000)
APP_NAME = "logprobe"
# A replica's engine keeps its cores busy for as long as requests wait. Run at a lower priority (nice
# 10: about a tenth of a nice-0 process's share of a contended core), it leaves the CPU the Serve proxy,
# the controller and the ingress need: on 2 cores with 2 replicas at nice 0, the proxy missed three
# 10 s health checks in a row under load and the controller killed it with every connection it held.
REPLICA_NICENESS = 10


def lower_priority(increment: int) -> None:
    """Nice every thread of this process (Linux keeps a nice value per thread; threads started later
    inherit their creator's, so the engine's thread and torch's pool started after this are niced too)."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the calling thread, which starts the engine
        tids = [0]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
        except OSError:
            log.debug("cannot renice thread %d", tid, exc_info=True)


def log_like_one_process(level: str) -> None:
    """In a Ray actor: logprobe's loggers (access lines, warnings, errors) to stderr at --log-level in
    one process's format; Ray shows an actor's stderr in the `logprobe serve` output, the actor's name
    in front. Serve's own loggers stay at WARNING (`deployment_options`)."""
    logger = logging.getLogger("logprobe")
    if not any(getattr(h, "logprobe_stderr", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        handler.logprobe_stderr = True
        logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


# ---- the model replica ------------------------------------------------------------------------------


class ModelReplica:
    def __init__(self, settings: Settings):
        # in the replica's process: torch, the engine and the model load there, not in the process
        # that builds the application
        import torch

        from ..api.serving.admission import Admission
        from ..api.shell.metrics import EngineMetrics
        from ..engine.engine import Engine

        log_like_one_process(settings.log_level)
        lower_priority(REPLICA_NICENESS)
        torch.set_num_threads(max(1, int(settings.cpus_per_replica)))
        (source, aliases), = resolve_models(settings)
        self.engine = Engine.from_settings(settings, source, aliases)
        self.engine.start()
        self.registry = CollectorRegistry()
        self.metrics = EngineMetrics(self.registry, self.engine.stats)
        self.engine.observe(*self.metrics.observers())
        a = settings.admission
        self.admission = Admission(settings.limits.max_tokens_in_flight, 0, a.max_queue, a.queue_timeout)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.state = ensure_state(settings)
        self._stop = threading.Event()
        threading.Thread(target=self._report_loop, name="logprobe-report", daemon=True).start()

    def _stats(self) -> dict:
        return {**self.engine.stats(), "pid": os.getpid(), "requests_running": self.admission.running,
                "requests_queued": self.admission.queue_depth, "tokens_held": self.admission.held}

    def _report_loop(self) -> None:
        while not self._stop.wait(REPORT_EVERY_S):
            try:
                self.state.report.remote(self.replica_id, self._stats(), generate_latest(self.registry))
            except Exception:  # the actor is gone with the application
                log.debug("report failed", exc_info=True)

    def __del__(self):
        self._stop.set()
        self.engine.stop()

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine loop died is replaced."""
        if self.engine._thread is None or not self.engine._thread.is_alive():
            raise RuntimeError("the engine's step loop is not running")

    def describe(self):
        """What the ingress needs to check and format requests: the model's info, tokenizer and table."""
        return self.engine.info, self.engine.tokenizer, self.engine.table

    def stats(self) -> dict:
        return self._stats()

    async def _hold(self, requests):
        try:
            return await self.admission.acquire("replica", sum(r.held_tokens for r in requests),
                                                priority=requests[0].priority), None
        except APIError as exc:
            return None, Refusal(exc)

    async def stream(self, requests: list[GenerationRequest], k: int | None):
        """The engine's stream (k None: no deltas, the outputs on its end), under the replica's own hold;
        a refusal, or a request whose own fields disagree (its 400), is carried back as data."""
        hold, refusal = await self._hold(requests)
        if refusal is not None:
            yield refusal
            return
        events = self.engine.stream(requests, k)
        try:
            async for event in events:
                yield event
        except RequestConflict as exc:
            yield conflict_refusal(exc)
        finally:
            await events.aclose()
            self.admission.release(hold, used=0)


def conflict_refusal(exc: RequestConflict) -> Refusal:
    """A request whose own fields leave nothing to generate, as the 400 the ingress answers."""
    return Refusal(InvalidRequest(exc.message, exc.param))


# ---- the ingress ------------------------------------------------------------------------------------


class Ingress:
    """The logprobe HTTP app, on a RayBackend (Serve calls __serve_build_asgi_app__ after __init__)."""

    async def __init__(self, model_handle, settings: Settings, target: str):
        log_like_one_process(settings.log_level)
        self.settings = settings
        self.state = ensure_state(settings)
        info, tokenizer, table = await model_handle.describe.remote()
        self.backend = RayBackend(model_handle, self.state, info, tokenizer, table, target)
        await self.backend.refresh()

    def __serve_build_asgi_app__(self):
        from ..server import attach_backend, create_app  # in the ingress's process, which serves HTTP

        s = self.settings
        admission = SharedAdmission(self.state, s.limits.max_tokens_in_flight, s.admission.tokens_per_minute,
                                    s.admission.queue_timeout)
        # the Batch API's runner runs here, in the front: its lines go to the replicas like requests
        self.http_app = create_app(None, s.limits, s.admission, s.api_keys, admission_control=admission,
                                   batch=s.batch)
        attach_backend(self.http_app, self.backend)
        return self.http_app

    async def drain(self) -> int:
        """Refuse new requests (503, as one process does on SIGTERM); returns the requests still running."""
        self.http_app.state.admission.drain()
        return self.http_app.state.admission.running

    async def running(self) -> int:
        return self.http_app.state.admission.running


# ---- the application ---------------------------------------------------------------------------------


def parse_replicas(value: str) -> tuple[int, int]:
    """`N` -> (N, N); `MIN:MAX` -> an autoscaled range."""
    try:
        low, _, high = value.partition(":")
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise ValueError(f"--replicas takes N or MIN:MAX, not {value!r}") from None
    if lo < 0 or hi < 1 or lo > hi:
        raise ValueError(f"--replicas {value}: need 0 <= MIN <= MAX and MAX >= 1")
    return lo, hi


def deployment_options(settings: Settings) -> tuple[dict, dict]:
    """The options of the ModelReplica and Ingress deployments that the flags decide."""
    lo, hi = parse_replicas(settings.replicas)
    actor_options = {"num_cpus": settings.cpus_per_replica}
    if settings.device.startswith("cuda"):
        actor_options["num_gpus"] = 1
    scaling = ({"num_replicas": lo} if lo == hi else
               {"autoscaling_config": {"min_replicas": lo, "max_replicas": hi, "target_ongoing_requests": 4}})
    quiet = {"log_level": "WARNING", "enable_access_log": False}
    drain = {"graceful_shutdown_timeout_s": settings.admission.drain_timeout, "graceful_shutdown_wait_loop_s": 0.2}
    model = {"name": "ModelReplica", "ray_actor_options": actor_options, "logging_config": quiet,
             "max_ongoing_requests": settings.max_ongoing_per_replica,
             # a dead replica is noticed within ~2 s; a busy one has 20 s to answer the check
             "health_check_period_s": 2, "health_check_timeout_s": 20, **drain, **scaling}
    ingress = {"name": "Ingress", "num_replicas": 1, "ray_actor_options": {"num_cpus": 0}, "logging_config": quiet,
               "max_ongoing_requests": 10_000, **drain}
    return model, ingress


def build_application(settings: Settings):
    """The Serve application (not yet running): ModelReplica x N behind the Ingress."""
    lo, hi = parse_replicas(settings.replicas)
    model_options, ingress_options = deployment_options(settings)
    model = serve.deployment(ModelReplica, **model_options)
    ingress = serve.deployment(serve.ingress()(Ingress), **ingress_options)
    target = str(lo) if lo == hi else f"{lo}:{hi}"
    return ingress.bind(model.bind(settings), settings, target)


def ensure_state(settings: Settings):
    """The application's ClusterState actor, created by whichever replica asks first (detached: it
    outlives any one replica; Ray restarts it if its process dies, with full budgets). Its calls are
    coroutines on one event loop; Ray caps an async actor at 1,000 running at once by default, and the
    budget's waiting takers would then hold up every other call (tokens given back, other keys, the
    replicas' reports): `STATE_CONCURRENCY` lifts the cap past any number of waiting requests."""
    return ray.remote(num_cpus=0, max_restarts=-1)(ClusterState).options(
        name=STATE_ACTOR, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        max_concurrency=STATE_CONCURRENCY,
    ).remote(settings.admission.tokens_per_minute)


def from_args(args: dict):
    """The application from a dict of `logprobe serve` flags (`{"model": ..., "replicas": "4",
    "api_key": ["k1"]}`): the builder `serve run` and KubeRay's RayService call
    (`import_path: logprobe.cluster.ray_app:from_args`). The flags mean what they mean on the command
    line, defaults and checks included."""
    argv = ["serve"]
    for name, value in (args or {}).items():
        flag = "--" + name.replace("_", "-")
        for item in value if isinstance(value, list) else [value]:
            argv += [flag, str(item)]
    settings = settings_from_args(build_parser().parse_args(argv))
    if not settings.replicas:
        settings.replicas = "1"
    return build_application(settings)


