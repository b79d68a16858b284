"""The ingress's side of the backend seam on Ray Serve: `RayBackend` sends each request's engine work
to a ModelReplica through a Serve handle (Serve routes it to a replica with room) and reads the
replicas' reports from the ClusterState actor for /health and /metrics (`ReplicaMetrics`).

What crosses the handle is plain picklable records (backend/); an API error raised on a replica comes
back as a `Refusal`, and a replica that died under a request ends it with `BackendUnavailable` (503
`unavailable`) rather than Ray's exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import ray
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from ..api.errors import APIError
from ..backend import BackendUnavailable, GenerationRequest
from .state import STALE_S

log = logging.getLogger("logprobe.cluster")

REPORT_EVERY_S = 1.0  # how often a replica reports its stats and metrics, and the ingress reads them


class Refusal:
    """An API error raised on a replica (its capacity queue is full, or the wait timed out), carried
    back as data: exceptions with their own constructors do not survive pickling."""

    def __init__(self, exc):
        self.status, self.message, self.param = exc.status, exc.message, exc.param
        self.type, self.code, self.headers = exc.type, exc.code, dict(exc.headers or {})

    def error(self):
        return APIError(self.message, self.param, status=self.status, code=self.code, type=self.type,
                        headers=self.headers)


def _replica_gone(exc: BaseException) -> bool:
    """Whether an error from a handle call means the replica (its process) is gone, not that the request
    failed there."""
    gone = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.WorkerCrashedError,
            ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError)
    return isinstance(exc, gone) or isinstance(getattr(exc, "cause", None), gone)


GONE = "The model replica serving this request went away ({}); try again."


class ReplicaMetrics:
    """A prometheus_client collector: every replica's engine metrics, from their latest reports, with a
    `replica` label (one family per metric, every replica's samples in it)."""

    def __init__(self, backend: "RayBackend"):
        self.backend = backend

    def collect(self):
        families: dict[str, Metric] = {}
        for replica, report in sorted(self.backend.snapshot.items()):
            if report["age"] > STALE_S:
                continue
            text = report["metrics"].decode() if isinstance(report["metrics"], bytes) else report["metrics"]
            for fam in text_string_to_metric_families(text):
                out = families.get(fam.name)
                if out is None:
                    out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                out.samples.extend(Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
                                   for s in fam.samples)
        return list(families.values())


class RayBackend:
    """The Backend protocol (backend/protocol.py) over a Serve handle to the ModelReplica deployment."""

    def __init__(self, handle, state, info, tokenizer, table, target: str):
        self.handle = handle
        self.state = state
        self.info, self.tokenizer, self.table = info, tokenizer, table
        self.target = target  # "2", or "1:8" when autoscaled
        self.snapshot: dict = {}
        self.metrics_collector = ReplicaMetrics(self)
        self._poller: asyncio.Task | None = None
        self._responses: dict[str, list] = {}

    steps_here = False  # the Backend protocol: the replicas run the steps and report them (collector)

    def observe(self, on_step, on_failure) -> None:
        """Nothing to observe here: each replica counts its own steps (ReplicaMetrics reads their reports)."""

    def collector(self) -> ReplicaMetrics:
        return self.metrics_collector

    def generated(self, request_id: str) -> None:
        """A replica cannot be asked: behind --replicas a request abandoned mid-run is charged its prompt
        only (docs/serving.md)."""
        return None

    # ---- reports
    def _ensure_polling(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            try:
                self.snapshot = await self.state.snapshot.remote()
            except Exception:
                log.warning("reading the replicas' reports failed", exc_info=True)
            await asyncio.sleep(REPORT_EVERY_S)

    async def refresh(self) -> None:
        self.snapshot = await self.state.snapshot.remote()
        self._ensure_polling()

    def stats(self) -> dict:
        try:
            self._ensure_polling()
        except RuntimeError:  # no running loop
            pass
        live = {r: rep["stats"] for r, rep in self.snapshot.items() if rep["age"] <= STALE_S}
        ready = [s for s in live.values() if not s.get("failing")]
        out = {"in_flight": sum(s["in_flight"] for s in live.values()),
               "steps": sum(s["steps"] for s in live.values()),
               "kv_cache_bytes": sum(s["kv_cache_bytes"] for s in live.values()),
**{key: sum(s.get(key, 0) for s in live.values()) for key in
                  ("prefix_cache_bytes", "prefix_cache_hits", "prefix_cache_misses", "prefix_cache_tokens_saved")},
               "failing": not ready,
               "step_failures": sum(s["step_failures"] for s in live.values()),
               "request_failures": sum(s["request_failures"] for s in live.values()),
               "replicas": {"ready": len(ready), "reporting": len(live), "target": self.target}}
        errors = [s["last_error"] for s in live.values() if "last_error" in s]
        if errors:
            out["last_error"] = max(errors, key=lambda e: e["at"])
        return out

    # ---- requests
    def _track(self, request_id: str, response) -> None:
        self._responses.setdefault(request_id, []).append(response)

    def _untrack(self, request_id: str, response) -> None:
        held = self._responses.get(request_id, [])
        if response in held:
            held.remove(response)
        if not held:
            self._responses.pop(request_id, None)

    @contextlib.contextmanager
    def _call(self, requests: list[GenerationRequest], response):
        """A handle call in flight: findable by `abort`, and a replica that died under it is
        BackendUnavailable (503 `unavailable`) rather than Ray's exception."""
        request_id = requests[0].request_id if requests else ""
        self._track(request_id, response)
        try:
            yield
        except Exception as exc:
            if _replica_gone(exc):
                raise BackendUnavailable(GONE.format(type(exc).__name__)) from None
            raise
        finally:
            self._untrack(request_id, response)

    async def stream(self, requests: list[GenerationRequest], k: int | None):
        """The replica's stream through a streaming handle call (k None: its end carries the outputs);
        closing it early, or cancelling the task that awaits it, cancels the call, and Serve cancels
        the replica's task: the engine drops the requests."""
        response = self.handle.options(stream=True).stream.remote(requests, k)
        finished = False
        try:
            with self._call(requests, response):
                async for event in response:
                    if isinstance(event, Refusal):
                        raise event.error()
                    yield event
                finished = True
        finally:
            if not finished:
                response.cancel()

    def abort(self, request_id: str) -> None:
        for response in list(self._responses.get(request_id, ())):
            response.cancel()
