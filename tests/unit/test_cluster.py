"""The parts of the Ray Serve application that run without a cluster: the shared token budget gives the
same answers as one process's hold, replicas' metrics merge into one family each, --replicas parses, and
the deployments ask Ray for what the flags say."""

from __future__ import annotations

import asyncio
import re
import threading

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from logprobe.api.serving.admission import BATCH_WAIT_S, Admission, AdmissionControl, RateLimited
from logprobe.api.errors import InvalidRequest
from logprobe.api.shell.metrics import EngineMetrics
from logprobe.cluster.state import ClusterState, SharedAdmission


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Local:
    """An object's methods called as a Ray actor handle's (`handle.method.remote(...)` is awaitable)."""

    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name):
        method = getattr(self.obj, name)

        class Remote:
            @staticmethod
            def remote(*args, **kwargs):
                result = method(*args, **kwargs)
                if asyncio.iscoroutine(result):
                    return asyncio.ensure_future(result)
                future = asyncio.get_running_loop().create_future()
                future.set_result(result)
                return future

        return Remote


async def _outcome(admission, key: str, tokens: int):
    try:
        hold = await admission.acquire(key, tokens)
    except (RateLimited, InvalidRequest) as exc:
        return None, (type(exc).__name__, exc.status, exc.code, exc.message, exc.headers)
    return hold, ("ok", hold.tokens, hold.headers)


def _script(admission, clock: Clock) -> list:
    """One sequence of holds and releases, with time moving between them."""

    async def main():
        out = []
        holds = []
        for key, tokens, advance in [("a", 300, 0), ("a", 300, 1), ("a", 300, 1), ("a", 300, 0.5),
                                     ("b", 300, 0), ("a", 2000, 0), ("a", 5000, 0), ("b", 600, 2)]:
            clock.now += advance
            hold, result = await _outcome(admission, key, tokens)
            out.append(result)
            if hold is not None:
                holds.append(hold)
        admission.release(holds[0], used=100)  # 200 unused tokens back to key a
        clock.now += 0.25
        await asyncio.sleep(0)  # a shared give-back is a message
        for key, tokens in [("a", 300), ("a", 200)]:
            hold, result = await _outcome(admission, key, tokens)
            out.append(result)
        return out

    return asyncio.run(main())


def test_both_admissions_are_admission_controls():
    """The API holds requests through the AdmissionControl protocol: one process's admission and the
    application's shared one both have all of it."""
    assert isinstance(Admission(capacity=100), AdmissionControl)
    shared = SharedAdmission(Local(ClusterState(1000, clock=Clock())), capacity=100, tokens_per_minute=1000,
                             queue_timeout=1.0)
    assert isinstance(shared, AdmissionControl)
    assert not isinstance(object(), AdmissionControl)


def test_the_shared_budget_answers_as_one_process():
    """Same keys, tokens and times: the same admissions, the same 429s (messages, Retry-After and the
    x-ratelimit headers) and the same over-capacity 400, from the ClusterState actor as from the hold of
    one process."""
    local_clock, shared_clock = Clock(), Clock()
    local = Admission(capacity=4000, tokens_per_minute=1000, max_queue=256, queue_timeout=1.0, clock=local_clock)
    state = Local(ClusterState(1000, clock=shared_clock))
    shared = SharedAdmission(state, capacity=4000, tokens_per_minute=1000, queue_timeout=1.0)
    expected = _script(local, local_clock)
    got = _script(shared, shared_clock)
    assert got == expected
    kinds = [r[0] for r in expected]
    assert kinds == ["ok", "ok", "ok", "RateLimited", "ok", "RateLimited", "InvalidRequest", "ok", "ok",
                     "RateLimited"], expected
    assert any("Rate limit reached for your key" in r[3] for r in expected if r[0] == "RateLimited")
    assert any("can never run" in r[3] for r in expected if r[0] == "RateLimited")


def test_a_short_wait_for_the_budget_is_served_in_order():
    """A request that needs a refill of less than queue_timeout waits for it (the actor's timer wakes the
    line at the refill time), and requests of one key take turns; another key does not wait behind them.
    The bucket's clock moves only when the test moves it, so nothing here depends on speed."""
    clock = Clock()
    state = ClusterState(6000, clock=clock)  # 100 tokens a second

    async def until(take):
        while not take.done():
            await asyncio.sleep(0.01)
        await _settle()  # its done callbacks run on the loop's next turn, not when done() turns true

    async def main():
        assert (await state.take("a", 5900, 1.0))["kind"] == "ok"  # 100 left
        served = []
        first = asyncio.ensure_future(state.take("a", 120, 30.0))  # needs 0.2 s of refill
        second = asyncio.ensure_future(state.take("a", 60, 30.0))  # then 0.6 s more
        for name, take in (("first", first), ("second", second)):
            take.add_done_callback(lambda _, name=name: served.append(name))
        await _settle()
        assert len(state._lines["a"].interactive) == 2  # both wait in key a's line
        other = await state.take("b", 6000, 1.0)  # had it waited behind them, they would be served first
        assert other["kind"] == "ok" and not first.done() and not second.done()
        await asyncio.sleep(0.5)  # the line's timer fires (every 0.2 s), but no time has passed for the bucket
        assert served == []
        clock.now += 0.19
        await asyncio.sleep(0.5)
        assert served == []  # 19 of the 20 tokens: not yet
        clock.now += 0.02
        await until(first)
        assert served == ["first"]  # the second waits for its own refill
        clock.now += 0.61
        await until(second)
        return served, [first.result()["kind"], second.result()["kind"]]

    served, kinds = asyncio.run(main())
    assert served == ["first", "second"] and kinds == ["ok", "ok"]
    assert asyncio.run(state.take("a", 6000, 0.1))["kind"] == "too_long"
    assert not state._lines


async def _settle():
    """Let every task started so far run up to its wait."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_keys_interactive_requests_take_its_budget_ahead_of_its_batch_lines():
    """The clock stands still, so only tokens given back refill the key. Batch lines queued first, an
    interactive request after them: the interactive one takes the first tokens that come back, the
    lines theirs afterwards in their order, and an interactive request arriving among them goes ahead
    of the lines still waiting (as one process's hold does; through SharedAdmission, which passes the
    priority)."""
    state = ClusterState(6000, clock=Clock())
    shared = SharedAdmission(Local(state), capacity=100_000, tokens_per_minute=6000, queue_timeout=30.0)

    async def main():
        await shared.acquire("a", 5990)  # 10 tokens left
        served = []

        def queue(name, priority):
            task = asyncio.ensure_future(shared.acquire("a", 100, priority))
            task.add_done_callback(lambda _: served.append(name))
            return task

        lines = [queue(f"line{i}", "batch") for i in range(3)]
        await _settle()
        first = queue("first", "interactive")
        await _settle()
        state.give_back("a", 100)
        assert (await first).priority == "interactive"
        assert served == ["first"] and not any(line.done() for line in lines)
        state.give_back("a", 100)
        await lines[0]
        second = queue("second", "interactive")
        await _settle()
        assert not second.done()  # it waits for tokens, not behind the lines
        state.give_back("a", 100)
        await second
        assert not lines[1].done()
        state.give_back("a", 200)
        holds = await asyncio.gather(*lines)
        return served, holds

    served, holds = asyncio.run(main())
    assert served == ["first", "line0", "second", "line1", "line2"]
    assert [hold.priority for hold in holds] == ["batch"] * 3
    assert state._bucket("a").level == 10  # every token given back was taken once
    assert not state._lines  # nobody left waiting


def test_a_keys_batch_lines_do_not_hold_up_other_keys():
    state = ClusterState(6000, clock=Clock())

    async def main():
        assert (await state.take("a", 6000, 1.0))["kind"] == "ok"
        line = asyncio.ensure_future(state.take("a", 100, BATCH_WAIT_S, "batch"))
        await _settle()
        other_line = await state.take("b", 100, BATCH_WAIT_S, "batch")
        other = await state.take("b", 5900, 1.0)
        waiting = not line.done()
        line.cancel()
        await _settle()
        return other_line, other, waiting and line.cancelled()

    other_line, other, waiting = asyncio.run(main())
    assert other_line["kind"] == "ok" and other["kind"] == "ok" and waiting
    assert not state._lines  # the cancelled line left its key's line


def test_an_interactive_request_the_budget_cannot_serve_in_time_still_gets_its_429():
    """Batch lines ahead change nothing for an interactive request the budget cannot serve within
    queue_timeout: "too_long" when the refill is known to take longer, "timeout" when it waited that
    long (the clock stands still); one that timed out or was cancelled leaves the line, and the
    lines behind it take the tokens given back."""
    state = ClusterState(6000, clock=Clock())  # 100 tokens a second

    async def main():
        assert (await state.take("a", 6000, 1.0))["kind"] == "ok"
        line = asyncio.ensure_future(state.take("a", 100, BATCH_WAIT_S, "batch"))
        await _settle()
        too_long = await state.take("a", 100, 0.5)  # 1 s of refill
        timeout = await state.take("a", 10, 0.2)  # 0.1 s of refill that never comes
        cancelled = asyncio.ensure_future(state.take("a", 10, 30.0))
        await _settle()
        cancelled.cancel()
        await _settle()
        state.give_back("a", 100)
        return too_long, timeout, cancelled.cancelled(), await line

    too_long, timeout, was_cancelled, line = asyncio.run(main())
    assert too_long["kind"] == "too_long" and too_long["wait"] == pytest.approx(1.0) and too_long["level"] == 0
    assert timeout["kind"] == "timeout" and timeout["headers"]["x-ratelimit-remaining-tokens"] == "0"
    assert was_cancelled and line["kind"] == "ok"
    assert state._bucket("a").level == 0 and not state._lines


class _Answers:
    """A budget actor's handle whose `take` calls the test answers itself."""

    def __init__(self):
        self.calls: list[asyncio.Future] = []
        self.given_back: list[tuple[str, int]] = []

        def take(key, tokens, timeout, priority):
            self.calls.append(asyncio.get_running_loop().create_future())
            return self.calls[-1]

        self.take = type("Remote", (), {"remote": staticmethod(take)})
        self.give_back = type("Remote", (), {"remote": staticmethod(lambda key, n: self.given_back.append((key, n)))})


@pytest.mark.parametrize("answered", [True, False])
def test_a_request_cancelled_while_it_waits_for_the_budget_takes_nothing(answered):
    """Cancelled while its `take` call is out, the request withdraws the call before it ends. Answered
    "ok" just before the cancellation reached it (the answer is in, the request has not run since), the
    tokens were taken for nobody: they go back. Not answered yet, the call is cancelled and nothing goes
    back (the actor's `take` settles a cancelled wait itself)."""
    state = _Answers()
    shared = SharedAdmission(state, capacity=1000, tokens_per_minute=600, queue_timeout=30.0)

    async def main():
        waiting = asyncio.ensure_future(shared.acquire("k", 300))
        while not state.calls:
            await asyncio.sleep(0)
        if answered:
            state.calls[0].set_result({"kind": "ok", "headers": {}})
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return state.calls[0].cancelled()

    call_cancelled = asyncio.run(main())
    assert state.given_back == ([("k", 300)] if answered else [])
    assert call_cancelled is not answered
    assert (shared.running, shared.held, shared.queue_depth, len(shared._withdrawals)) == (0, 0, 0, 0)


def test_a_drained_ingress_refuses_and_gives_the_budget_back():
    state = ClusterState(1000, clock=Clock())
    shared = SharedAdmission(Local(state), capacity=4000, tokens_per_minute=1000, queue_timeout=1.0)
    shared.drain()
    from logprobe.api.errors import Unavailable

    with pytest.raises(Unavailable):
        asyncio.run(shared.acquire("a", 10))
    assert state._bucket("a").level == 1000 and shared.running == 0 and shared.held == 0


@pytest.fixture(scope="module")
def ray_app():
    return pytest.importorskip("logprobe.cluster.ray_app", reason="Ray Serve is not installed")


def _replica_text(steps: int) -> bytes:
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, lambda: {"in_flight": 1, "kv_cache_bytes": 2048})
    observe_step, observe_failure = metrics.observers()
    for _ in range(steps):
        observe_step(0.01, 3)
    observe_failure("request")
    return generate_latest(registry)


def test_every_replicas_metrics_in_one_family_each(ray_app):
    from logprobe.cluster.ray_backend import ReplicaMetrics

    class Backend:
        snapshot = {"r1": {"age": 0.5, "stats": {}, "metrics": _replica_text(3)},
                    "r2": {"age": 0.2, "stats": {}, "metrics": _replica_text(5)},
                    "gone": {"age": 30.0, "stats": {}, "metrics": _replica_text(7)}}

    registry = CollectorRegistry()
    registry.register(ReplicaMetrics(Backend()))
    text = generate_latest(registry).decode()
    assert text.count("# TYPE logprobe_engine_step_seconds histogram") == 1
    counts = dict(re.findall(r'^logprobe_engine_step_seconds_count\{replica="(\w+)"\} (\S+)$', text, re.M))
    assert counts == {"r1": "3.0", "r2": "5.0"}  # a replica silent for 30 s is left out
    assert 'logprobe_engine_failures_total{kind="request",replica="r2"} 1.0' in text
    assert 'logprobe_kv_cache_bytes{replica="r1"} 2048.0' in text


def test_the_ray_backend_is_a_backend(ray_app):
    """The Backend protocol declares all the API calls: the Ray backend has it, steps elsewhere, brings
    its replicas' metrics as a collector, and cannot tell what an abandoned request generated."""
    from logprobe.backend import Backend
    from logprobe.cluster.ray_backend import RayBackend, ReplicaMetrics

    backend = RayBackend(handle=None, state=None, info=None, tokenizer=None, table=None, target="2")
    assert isinstance(backend, Backend)
    assert backend.steps_here is False and isinstance(backend.collector(), ReplicaMetrics)
    assert backend.generated("any") is None
    backend.observe(lambda seconds, rows: None, lambda kind: None)  # nothing to observe in this process


@pytest.mark.parametrize("value,expected", [("2", (2, 2)), ("1:8", (1, 8)), ("0:3", (0, 3))])
def test_replicas_parse(ray_app, value, expected):
    assert ray_app.parse_replicas(value) == expected


@pytest.mark.parametrize("value", ["", "x", "3:1", "0", "1:2:3", "-1:2"])
def test_bad_replicas_are_refused(ray_app, value):
    with pytest.raises(ValueError, match="--replicas"):
        ray_app.parse_replicas(value)


def test_deployments_ask_for_what_the_flags_say(ray_app):
    from logprobe.config import Settings

    model, ingress = ray_app.deployment_options(Settings(replicas="3", cpus_per_replica=1.5))
    assert model["num_replicas"] == 3 and model["ray_actor_options"] == {"num_cpus": 1.5}
    assert "autoscaling_config" not in model and model["max_ongoing_requests"] == 64
    assert ingress["ray_actor_options"] == {"num_cpus": 0} and ingress["num_replicas"] == 1
    model, _ = ray_app.deployment_options(Settings(replicas="1:8", device="cuda", max_ongoing_per_replica=8))
    assert model["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1}
    assert "num_replicas" not in model and model["max_ongoing_requests"] == 8
    assert (model["autoscaling_config"]["min_replicas"], model["autoscaling_config"]["max_replicas"]) == (1, 8)
    ray_app.build_application(Settings(replicas="1:8"))  # Serve accepts these options
    ray_app.build_application(Settings(replicas="2"))


def test_the_application_builder_reads_serve_flags(ray_app):
    """`from_args` (serve run / KubeRay) takes the flags of `logprobe serve` with their defaults."""
    from logprobe.config import build_parser, settings_from_args

    seen = []
    real = ray_app.build_application
    ray_app.build_application = lambda settings: seen.append(settings) or real(settings)
    try:
        ray_app.from_args({"replicas": "1:4", "cpus_per_replica": 2, "api_key": ["k1", "k2"],
                           "tokens_per_minute": 5000, "max_n": 4})
        ray_app.from_args({})
    finally:
        ray_app.build_application = real
    full, bare = seen
    assert (full.replicas, full.cpus_per_replica, full.api_keys) == ("1:4", 2.0, ["k1", "k2"])
    assert full.admission.tokens_per_minute == 5000 and full.limits.max_n == 4
    assert bare.replicas == "1"
    defaults = settings_from_args(build_parser().parse_args(["serve"]))
    assert bare.limits == defaults.limits and bare.admission == defaults.admission
    with pytest.raises(SystemExit):
        ray_app.from_args({"no_such_flag": 1})


def test_the_application_reads_settings_without_the_cli(ray_app):
    """ray_app builds its settings from config.py alone: importing it (as Serve's workers and `serve run`
    do) does not import the command line module, which imports ray_app to run it."""
    import subprocess
    import sys

    code = "import sys, logprobe.cluster.ray_app; print(sorted(m for m in sys.modules if m == 'logprobe.cli'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_a_replica_carries_a_requests_conflict_back_as_its_400(ray_app):
    """A request whose own fields leave nothing to generate fails on the replica with RequestConflict:
    it comes back as the 400 the ingress answers (Ray would otherwise wrap it as an exception whose
    fields do not survive), answered whole (a stream without deltas) or streamed, and the replica's hold
    is given back."""
    from logprobe.backend import GenerationRequest, RequestConflict, SamplingParams

    conflict = RequestConflict("Invalid request: 'allowed_token_ids' and 'bad_words' together allow no token at "
                               "generated token 2, ...", "allowed_token_ids")

    class Engine:
        async def stream(self, requests, k):
            if k is not None:
                yield ["first"]
            raise conflict

        def stop(self):
            pass

    replica = object.__new__(ray_app.ModelReplica)
    replica.engine, replica.admission, replica._stop = Engine(), Admission(100, 0, 10, 1.0), threading.Event()
    request = GenerationRequest("r", [1, 2], SamplingParams(max_tokens=3))

    async def both():
        whole = [event async for event in replica.stream([request], None)]
        streamed = [event async for event in replica.stream([request], 0)]
        return whole, streamed

    whole, streamed = asyncio.run(both())
    assert streamed[0] == ["first"] and len(streamed) == 2 and len(whole) == 1
    ran = whole[0]
    for refusal in (ran, streamed[1]):
        err = refusal.error()
        assert (err.status, err.code, err.param, err.message) == (400, "invalid_request", "allowed_token_ids",
                                                                  conflict.message)
    assert replica.admission.held == 0
