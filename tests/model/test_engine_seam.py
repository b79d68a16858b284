"""The engine's side of the backend seam: abort, and streams that equal the answer without streaming."""

from __future__ import annotations

import asyncio
import queue
import time

import pytest

from logprobe.backend import GenerationRequest, RequestAborted, SamplingParams
from logprobe.engine.engine import Engine
from logprobe.engine.host.request import SequenceGroup
from logprobe.engine.host.streaming import Releaser


def test_the_groups_of_one_submit_reach_the_scheduler_together(tiny_model, tokenizer):
    """The groups of one submit (a request's prompts and choices) are scheduled together however the
    threads run, so the passes they share, and their numbers, do not depend on timing. Here every put
    into the inbox is followed by a pause in which the engine thread, woken by it, runs: unless it
    waits for the rest of the submit, it steps the first group alone."""

    class SlowInbox(queue.SimpleQueue):
        def put(self, item, block=True, timeout=None):
            super().put(item, block, timeout)
            time.sleep(0.05)

    engine = Engine(tiny_model, tokenizer, "t", [])
    engine._inbox = SlowInbox()
    steps, real_step = [], engine.step

    def step(plan):
        steps.append(sorted(g.request_id for g in plan.groups))
        real_step(plan)

    engine.step = step
    engine.start()
    try:
        groups = [SequenceGroup(f"r{i}", [1, 5 + i, 6], SamplingParams(max_tokens=2, temperature=0.0), engine.table)
                  for i in range(3)]
        asyncio.run(engine.run_groups(groups))
    finally:
        engine.stop()
    assert steps[0] == ["r0", "r1", "r2"], steps
    assert all(len(g.sequences[0].token_ids) == 2 for g in groups)


def test_abort_ends_the_awaiting_run(tiny_engine):
    """`abort` by request id: the awaiting run raises RequestAborted instead of waiting forever, and the
    engine is left with nothing in flight and serves the next request."""
    request = GenerationRequest("req_abort", [1, 5, 6], SamplingParams(max_tokens=200, temperature=0.0))

    async def main():
        start = tiny_engine.num_steps
        task = asyncio.ensure_future(tiny_engine.run([request]))
        while tiny_engine.num_steps < start + 2:  # running: its prompt and first token are done
            await asyncio.sleep(0.001)
        tiny_engine.abort("req_abort")
        with pytest.raises(RequestAborted):
            await asyncio.wait_for(task, 10)
        (out,) = await tiny_engine.run([GenerationRequest("after", [1, 5, 6], SamplingParams(max_tokens=3,
                                                                                            temperature=0.0))])
        return out

    out = asyncio.run(main())
    assert len(out.choices[0].token_ids) == 3
    assert tiny_engine.stats()["in_flight"] == 0


def _feed(engine: Engine, tokens: list[int], stop: list[str]):
    """Run the engine's own stop rule and Releaser over a fixed token sequence; (streamed ids, kept ids)."""
    params = SamplingParams(max_tokens=len(tokens) + 5, stop=stop)
    group = SequenceGroup("t", [1], params, engine.table)
    seq = group.sequences[0]
    releaser = Releaser(seq, group, 0, max((len(s) for s in stop), default=1) - 1, bool(stop))
    streamed = []
    for token in tokens:
        seq.token_ids.append(token)
        seq.logprobs.append(0.0)
        engine.outputs.check_stop(seq, group)
        delta = releaser.release(0)
        if delta is not None:
            streamed += delta.token_ids.tolist()
        if seq.is_finished:
            break
    return streamed, seq.token_ids[:seq.num_kept_tokens]


def test_an_empty_token_where_a_stop_string_begins_is_not_streamed(tiny_engine, tokenizer):
    """A token without text (here the end-of-text special token) right where a stop string later begins
    is cut from the answer, so the stream must not have sent it either."""
    hello = tokenizer("hello", add_special_tokens=False).input_ids
    xyz = tokenizer("XYZ", add_special_tokens=False).input_ids
    empty = 0
    assert tiny_engine.table.text_bytes(empty) == b""
    streamed, kept = _feed(tiny_engine, hello + [empty] + xyz, ["XYZ"])
    assert kept == hello
    assert streamed == kept
    # with a stop string the empty token waits for the next one; without, nothing is held back
    streamed, kept = _feed(tiny_engine, hello + [empty], ["Q"])
    assert streamed == hello and kept == hello + [empty]
    streamed, kept = _feed(tiny_engine, hello + [empty], [])
    assert streamed == kept == hello + [empty]
