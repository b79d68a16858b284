"""Batch lines and interactive requests over HTTP, on the real engine (the tiny random model, the real
admission, scheduler and output processor): with 200 batch lines queued (in admission and in the
engine), an interactive request is admitted at once and its prompt runs in the next engine step, its
first token with it; every batch line is still answered. Steps are counted, never seconds: the engine
is held between steps while the requests are placed.

A batch line is sent as the batch runner sends it: through the app's pipeline with a `Call` of
priority "batch" (batch/runner.py); the interactive request comes over HTTP, whose calls are always
interactive."""

from __future__ import annotations

import asyncio
import threading

import httpx
import orjson
import pytest

from logprobe.api.app import create_app
from logprobe.api.errors import new_request_id
from logprobe.api.registry import COMPLETIONS
from logprobe.api.serving.holding import Call
from logprobe.backend import BATCH
from logprobe.config import Limits
from logprobe.engine.engine import Engine
from paused_engine import paused_after

NUM_LINES = 200
PATIENCE_S = 300  # how long a wait for the engine may take before the test fails (a hang, not a speed check)


class Steps:
    """Lets the engine plan a given number of steps, and records each plan (by request id) and when each
    group was queued (the number of plans made before it)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self._schedule, self._add = scheduler.schedule, scheduler.add
        self.allowed = 0
        self.cond = threading.Condition()
        self.plans: list[dict] = []
        self.queued_at: dict[str, int] = {}
        scheduler.schedule, scheduler.add = self.schedule, self.add

    def add(self, group) -> None:
        self.queued_at[group.request_id] = len(self.plans)
        self._add(group)

    def schedule(self, *args, **kwargs):  # also the interactive steps between a batch pass's blocks
        with self.cond:
            self.cond.wait_for(lambda: self.allowed > 0)
            self.allowed -= 1
        plan = self._schedule(*args, **kwargs)
        if plan is not None:
            prompts = plan.score + [c.group for c in plan.prefill]
            self.plans.append({"prompt": [(g.request_id, g.priority) for g in prompts],
                               "decode": [g.request_id for g in plan.decode]})
        return plan

    def allow(self, num: int) -> None:
        with self.cond:
            self.allowed += num
            self.cond.notify_all()

    def first_plan(self, request_id: str, kind: str) -> int:
        return next(i for i, plan in enumerate(self.plans)
                    if request_id in (plan[kind] if kind == "decode" else [r for r, _ in plan[kind]]))


@pytest.fixture
def engine(tiny_model, tokenizer):
    engine = Engine(tiny_model, tokenizer, "test/tiny-llama", ["tiny"])
    steps = Steps(engine.scheduler)
    engine.start()
    yield engine, steps
    steps.allow(1 << 30)
    engine.stop()


async def until(condition, what: str) -> None:
    """Wait for a state of the server (polling, so no step is assumed to take any time)."""
    for _ in range(PATIENCE_S * 100):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"waited {PATIENCE_S} s for {what}")


def line_body(i: int) -> dict:
    """Batch lines of both kinds: generating, and (the last few) prompt-only, echo with log probabilities
    (few: each costs a whole-vocabulary row per position on this CPU)."""
    prompt = f"Line {i}" + " and more" * (i % 4)
    if i >= NUM_LINES - 10:
        return {"model": "tiny", "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    return {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}


@pytest.mark.parametrize("capacity", [131_072, 1_500])  # every line admitted / most wait in admission
def test_an_interactive_request_runs_in_the_next_step_among_200_batch_lines(engine, capacity):
    engine, steps = engine
    app = create_app(engine, Limits(max_tokens_in_flight=capacity))
    admission = app.state.admission

    submitted = []  # every group the server queued for the engine, when it queued it
    submit = engine.submit

    def record_submit(groups):
        submitted.extend(groups)
        return submit(groups)

    engine.submit = record_submit

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=None) as client:
            pipeline = app.state.pipeline
            lines = [asyncio.ensure_future(pipeline.answer(COMPLETIONS, line_body(i),
                                                           Call(new_request_id(), priority=BATCH)))
                     for i in range(NUM_LINES)]
            await until(lambda: engine.num_in_flight + admission.batch_queue_depth == NUM_LINES,
                        "the batch lines to be queued")
            # three steps, then the engine's thread is held at the end of the third (its outputs
            # processed, the next plan not begun) while the interactive request is sent
            with paused_after(engine, 3) as paused:
                steps.allow(1 << 30)
                await until(paused.is_set, "three engine steps")
                queued = len([g for g in engine.scheduler.waiting if g.is_batch]) + admission.batch_queue_depth
                assert queued > NUM_LINES // 2  # most batch lines are still waiting for the engine or a hold
                interactive = asyncio.ensure_future(client.post("/v1/completions", json={
                    "model": "tiny", "prompt": "An interactive question", "max_tokens": 4, "temperature": 0,
                    "logprobs": 2}))
                # admitted at once, whatever the batch lines hold: it reaches the engine with no step run
                await until(lambda: any(not g.is_batch for g in submitted), "the interactive request's hold")
                num_plans = len(steps.plans)
                assert num_plans == 3
            answer = await interactive
            answers = await asyncio.gather(*lines)
        return answer, answers, num_plans, queued

    answer, answers, num_plans, queued = asyncio.run(main())
    assert answer.status_code == 200 and len(answer.json()["choices"][0]["logprobs"]["tokens"]) == 4
    request_id = answer.headers["x-request-id"]
    assert steps.queued_at[request_id] == num_plans  # queued before the engine's next plan ...
    first = steps.first_plan(request_id, "prompt")
    assert first == num_plans  # ... and its prompt is in that plan, with no batch prompt beside it
    assert all(priority == "interactive" for _, priority in steps.plans[first]["prompt"])
    assert steps.first_plan(request_id, "decode") == first + 1  # its first token came with its prompt
    assert len(answers) == NUM_LINES  # every line answered (an error would have been raised)
    for i, body in enumerate(answers):  # ... in full
        body = orjson.loads(body)
        choice, usage = body["choices"][0], body["usage"]
        if i >= NUM_LINES - 10:  # the prompt, echoed with its log probabilities
            assert usage["completion_tokens"] == 0 and len(choice["logprobs"]["tokens"]) == usage["prompt_tokens"]
        else:
            assert usage["completion_tokens"] == 4 or choice["finish_reason"] == "stop"
    assert (admission.held, admission.batch_held, admission.running, admission.batch_queue_depth) == (0, 0, 0, 0)
