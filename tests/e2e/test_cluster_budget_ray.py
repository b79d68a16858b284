"""The shared token budget on a real Ray actor: a request that is cancelled while its key's budget keeps
it waiting (its client left, its batch was cancelled) takes nothing when its turn would have come. On
Ray, being cancelled while awaiting an actor's call leaves the call running; the ingress cancels it.

Slow: a local Ray cluster is started for the module."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install 'logprobe[ray]')")
pytestmark = pytest.mark.e2e

BUDGET = 600  # tokens a minute: 10 a second


@pytest.fixture(scope="module")
def ray_started():
    import ray

    from logprobe.cluster import local_ray_environment

    local_ray_environment(joining=False)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.parametrize("priority", ["batch", "interactive"])
def test_a_cancelled_wait_for_the_budget_takes_nothing(ray_started, priority):
    from logprobe.cluster.state import ClusterState, SharedAdmission

    ray = ray_started
    state = ray.remote(ClusterState).remote(BUDGET)
    admission = SharedAdmission(state, capacity=10_000, tokens_per_minute=BUDGET, queue_timeout=600)

    async def scenario():
        first = await admission.acquire("k", BUDGET - 5, priority)  # 5 tokens left
        waiting = asyncio.ensure_future(admission.acquire("k", 300, priority))  # needs ~30 s of refill
        while admission.queue_depth == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # the call has reached the actor and waits in the key's line
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        admission.release(first, used=0)  # all of it back: the bucket is full again
        # An interactive request that needs the whole bucket is served only if the cancelled one took
        # nothing: had its call stayed in the key's line, the tokens given back would serve it first (300
        # taken), and this one would be refused (a 30 s wait for the refill, past its 2 s queue_timeout).
        late = SharedAdmission(state, capacity=10_000, tokens_per_minute=BUDGET, queue_timeout=2)
        hold = await late.acquire("k", BUDGET)
        assert hold.tokens == BUDGET

    asyncio.run(scenario())


def test_the_application_budget_serves_other_calls_beside_a_thousand_waiting_requests(ray_started):
    """Ray runs at most 1,000 of an async actor's calls at once unless told otherwise: past 1,000
    requests waiting for one key's budget, every other call (another key's take, tokens given back, the
    replicas' reports) would wait behind them. The application's actor (`ensure_state`) takes more."""
    from types import SimpleNamespace

    from logprobe.cluster.ray_app import ensure_state

    ray = ray_started
    state = ensure_state(SimpleNamespace(admission=SimpleNamespace(tokens_per_minute=BUDGET)))
    try:
        assert ray.get(state.take.remote("a", BUDGET, 1.0))["kind"] == "ok"  # key a's bucket is empty
        # 1,100 takes of key a wait for a whole bucket each: one served a minute, in line
        waiting = [state.take.remote("a", BUDGET, 7200.0) for _ in range(1_100)]
        other = ray.get(state.take.remote("b", 10, 1.0), timeout=600)
        ray.get(state.report.remote("replica", {}, b""), timeout=600)
        assert other["kind"] == "ok"
        assert "replica" in ray.get(state.snapshot.remote(), timeout=600)
        # the other calls were served beside them: at Ray's default cap they would have waited until
        # 101 of the takes had been served (over 100 minutes)
        ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=0)
        assert len(ready) < 100
    finally:
        ray.kill(state)
