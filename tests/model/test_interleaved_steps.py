"""A prompt-only pass that takes several engine steps (engine/core.py `_advance`: it pauses at a block
where other work waits, and the next step goes on with it), on the real engine and the tiny random
model: an interactive request that arrives while a pass of batch scoring lines runs has its prompt
run, and its first token picked, in the step after the next block, before that pass ends; the batch
lines get the same numbers as the same pass without pauses, and the interactive requests the same as
alone (bit for bit), and all the float64 reference's within the usual tolerance. The engine thread is
held at the pass's first pause point while the test queues the interactive requests, and the batch
lines reach the scheduler together: nothing depends on how fast either side runs.
"""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager

import numpy as np
import pytest

from logprobe.engine.engine import Engine
from logprobe.engine.host.request import SamplingParams, SequenceGroup

PATIENCE_S = 600  # bounds a hang only
TOL = 1e-5


def make(engine, text: str, priority: str = "interactive", **params) -> SequenceGroup:
    group = SequenceGroup(f"{priority}-{text[:12]}", engine.tokenizer(text).input_ids, SamplingParams(**params),
                          engine.table)
    group.priority = priority
    return group


def batch_lines(engine) -> list[SequenceGroup]:
    texts = [f"Batch line {i} " + "with more words " * (i % 5) for i in range(8)]
    return [make(engine, t, "batch", max_tokens=0, echo=True, logprobs=2) for t in texts]


def interactive_requests(engine) -> list[SequenceGroup]:
    return [make(engine, "An interactive text to score", max_tokens=0, prompt_logprobs=2),
            make(engine, "An interactive question about rivers", max_tokens=5, temperature=0, logprobs=3)]


@pytest.fixture
def engine(tiny_model, tokenizer):
    engine = Engine(tiny_model, tokenizer, "test/tiny-llama", ["tiny"])
    engine.start()
    yield engine
    engine.stop()


@contextmanager
def gathered(engine):
    """Groups submitted inside the block reach the scheduler together when it is left (the engine
    thread waits before it next takes from its inbox), so the passes they share are always the same."""
    at_gate, gate_open = threading.Event(), threading.Event()
    original = engine._drain_inbox

    def drain(block: bool) -> None:
        at_gate.set()
        assert gate_open.wait(PATIENCE_S)
        original(block)

    engine._drain_inbox = drain
    assert at_gate.wait(PATIENCE_S)
    try:
        yield
    finally:
        del engine._drain_inbox
        gate_open.set()


def copies(groups: list[SequenceGroup], table) -> list[SequenceGroup]:
    made = [SequenceGroup(g.request_id, g.prompt_ids, g.params, table) for g in groups]
    for new, old in zip(made, groups):
        new.priority = old.priority
    return made


def numbers(group: SequenceGroup) -> dict:
    cols = group.prompt_columns
    out = {"prompt": None if cols is None else (cols.logprobs.tobytes(), cols.ranks.tobytes(),
                                               cols.top_ids.tobytes(), cols.top_logprobs.tobytes())}
    out["tokens"] = [list(s.token_ids) for s in group.sequences]
    out["logprobs"] = [np.asarray(s.logprobs, dtype=np.float32).tobytes() for s in group.sequences]
    return out


class FirstBlock:
    """Stands in for the engine's `_pause_point` (where a prompt-only pass may end its step, after each
    block and before each head run): holds the engine at the first pause point of the watched pass (a
    batch one, or an interactive one with `batch=False`) until `run` has queued the asked requests, then
    lets each call through, `seen(positions)` (if given) called first at each of the watched pass's
    pause points with what its block ran (0 before a head run)."""

    def __init__(self, engine, seen=None, batch: bool = True):
        self.engine, self.seen, self.batch = engine, seen, batch
        self.original = engine._pause_point
        self.in_pass, self.queued = threading.Event(), threading.Event()

    def __call__(self, prompt_pass, positions: int) -> bool:
        if prompt_pass.is_batch == self.batch:
            if not self.in_pass.is_set():
                self.in_pass.set()  # the pass has begun: hold it until the asked requests are queued
                assert self.queued.wait(PATIENCE_S)
            if self.seen is not None:
                self.seen(positions)
        return self.original(prompt_pass, positions)

    def run(self, first: list[SequenceGroup], asked: list[SequenceGroup], **gather) -> None:
        """Queue the `first` groups together, then the asked ones once the watched pass's first pause
        point is reached; wait for all of them (`gather`: asyncio.gather's options)."""
        engine = self.engine

        async def main():
            with gathered(engine):
                first_done = engine.submit(first)
            await asyncio.get_running_loop().run_in_executor(None, self.in_pass.wait, PATIENCE_S)
            asked_done = engine.submit(asked)
            self.queued.set()
            await asyncio.gather(*asked_done, *first_done, **gather)

        engine._pause_point = self
        try:
            asyncio.run(main())
        finally:
            del engine._pause_point
        assert self.in_pass.is_set()


def assert_as_alone(engine, group: SequenceGroup) -> None:
    """The group's numbers are those a copy of it gets run alone, bit for bit."""
    alone, = copies([group], engine.table)
    asyncio.run(engine.run_groups([alone]))
    assert numbers(alone) == numbers(group), group.request_id


def assert_greedy_as_reference(reference, group: SequenceGroup) -> None:
    """A greedy group's tokens are the float64 reference's argmax at each step, their log probabilities
    the reference's within TOL."""
    seq = group.sequences[0]
    ref = reference.logprobs(group.prompt_ids + seq.token_ids).numpy()
    start = len(group.prompt_ids) - 1
    assert seq.token_ids == [int(np.argmax(ref[start + i])) for i in range(len(seq.token_ids))]
    np.testing.assert_allclose(seq.logprobs, [ref[start + i][t] for i, t in enumerate(seq.token_ids)], atol=TOL)


def test_an_interactive_request_runs_at_the_next_block_of_a_batch_pass(engine, reference):
    assert engine.scheduler.interleaves
    lines, asked = batch_lines(engine), interactive_requests(engine)
    seen = []  # at each pause point of the batch pass, before the engine decides whether to pause

    def at_pause_point(positions: int) -> None:
        seen.append({"step": engine.num_steps, "asked_done": [g.is_finished for g in asked],
                     "tokens": len(asked[1].sequences[0].token_ids),
                     "lines_done": sum(g.is_finished for g in lines)})

    FirstBlock(engine, at_pause_point).run(lines, asked)
    assert len(seen) > 2
    first, second = seen[0], seen[1]
    # the pass paused at its first block; the next step ran both prompts (the scoring request's own pass
    # whole, the generation's first token) and the step after it went on with the batch pass, which then
    # advanced a block per step while the generation decoded, no batch line done before it ended
    assert first == {"step": first["step"], "asked_done": [False, False], "tokens": 0, "lines_done": 0}
    assert second["step"] == first["step"] + 2 and second["asked_done"][0] and second["tokens"] == 2
    running = [s for s in seen[1:] if not s["asked_done"][1]]
    assert [s["step"] for s in running] == list(range(second["step"], second["step"] + len(running)))
    assert all(s["lines_done"] == 0 for s in seen)
    assert all(g.error is None for g in lines + asked)

    # the batch lines' numbers are those of the same pass uninterrupted, the interactive requests' those
    # they get alone, bit for bit; and all are the float64 reference's
    assert_as_uninterrupted(engine, lines)
    for group in asked:
        assert_as_alone(engine, group)
    for group in [*lines, asked[0]]:
        ref = reference.logprobs(group.prompt_ids).numpy()
        want = [ref[i - 1][group.prompt_ids[i]] for i in range(1, len(group.prompt_ids))]
        np.testing.assert_allclose(group.prompt_columns.logprobs[1:], want, atol=TOL)
    assert_greedy_as_reference(reference, asked[1])


@pytest.mark.parametrize("decode_every", [512, 16])
def test_a_stream_is_prefilled_at_the_next_block_of_a_scoring_pass(engine, reference, decode_every):
    """Interactive scoring requests in a prompt-only pass, and a generation that arrives once the pass
    has begun: the pass pauses at its first block, and the next step runs the generation's prompt and
    picks its first token before it goes on with the pass, no scoring request answered yet
    (`_beside_interactive_pass`). The generation decodes a step once the pass has run
    `score_batch_tokens_decoding` padded tokens since it began decoding: the pass here is ~100 tokens, so
    with the default (512) not before the pass ends, with 16 at the pass's second block (the tiny model's
    last; the head runs count none), after which the pass ends in that step. The scoring requests'
    numbers are those of the same pass uninterrupted, the generation's those it gets alone, bit for bit,
    and the reference's."""
    engine.scheduler.score_batch_tokens_decoding = decode_every
    scores = [make(engine, f"Scoring text {i} " + "with a few more words " * (3 + i), max_tokens=0, prompt_logprobs=2)
              for i in range(3)]
    stream = make(engine, "An interactive question about rivers", max_tokens=5, temperature=0, logprobs=3)
    seen = []

    def at_pause_point(positions: int) -> None:
        seen.append({"step": engine.num_steps, "block": positions > 0, "tokens": len(stream.sequences[0].token_ids),
                     "scored": sum(g.is_finished for g in scores)})

    FirstBlock(engine, at_pause_point, batch=False).run(scores, [stream])
    padded = len(scores) * max(len(g.prompt_ids) for g in scores)
    assert engine.info.num_layers == 2 and padded < 512 and 2 * padded >= engine.info.num_layers * 16
    first = seen[0]["step"]
    assert seen[0] == {"step": first, "block": True, "tokens": 0, "scored": 0}
    assert seen[1] == {"step": first + 1, "block": True, "tokens": 1, "scored": 0}  # its prompt, then a block
    if decode_every == 16:  # a decode step, then the rest of the pass
        assert {(s["step"], s["tokens"]) for s in seen[2:]} == {(first + 2, 2)}
    else:  # the rest of the pass in the step that ran the prompt
        assert {(s["step"], s["tokens"]) for s in seen[2:]} == {(first + 1, 1)}
    assert len(seen) > 2 and not any(s["block"] for s in seen[2:]) and not any(s["scored"] for s in seen)
    assert all(g.error is None and g.is_finished for g in [*scores, stream])
    assert_as_uninterrupted(engine, scores)
    assert_as_alone(engine, stream)
    assert_greedy_as_reference(reference, stream)


def test_running_rows_decode_between_the_blocks_of_a_long_scoring_prompt(engine, reference):
    """A stream decoding when a long scoring prompt's pass begins (both sent together: the stream's
    prompt runs first, the pass in the next step) decodes a step between the pass's blocks once per
    `score_batch_tokens_decoding` padded tokens of it (64 here: a 200-token pass through 2 blocks gives
    one after each block: the pass pauses there and the next step decodes, then goes on with it), and
    ends with the float64 reference's greedy tokens and log probabilities, its numbers those it gets
    alone, bit for bit; the scoring prompt's those of the same pass uninterrupted."""
    engine.scheduler.score_batch_tokens_decoding = 64
    stream = make(engine, "An interactive question about rivers", max_tokens=12, temperature=0, logprobs=3)
    ids = (engine.tokenizer("A long text to score, " + "one river after another " * 60).input_ids)[:200]
    score = SequenceGroup("interactive-long", ids, SamplingParams(max_tokens=0, prompt_logprobs=2), engine.table)
    assert len(ids) == 200 and engine.info.num_layers == 2
    original, seen = engine._pause_point, []

    def counted(prompt_pass, positions: int) -> bool:
        seen.append((positions, engine.num_steps, len(stream.sequences[0].token_ids)))
        return original(prompt_pass, positions)

    async def main():
        with gathered(engine):
            done = engine.submit([stream, score])
        await asyncio.gather(*done)

    engine._pause_point = counted
    try:
        asyncio.run(main())
    finally:
        del engine._pause_point
    assert all(g.error is None and g.is_finished for g in (stream, score))
    blocks = [(step, tokens) for positions, step, tokens in seen if positions]
    heads = {(step, tokens) for positions, step, tokens in seen if not positions}
    # the pass began in the step after the prompt's (which gave the first token) and decoded before
    # it: a token, then a step and a token after each block, the head runs in the last of them
    (step, tokens), _ = blocks
    assert tokens == 2 and blocks == [(step, 2), (step + 1, 3)] and heads == {(step + 2, 4)}
    assert_as_uninterrupted(engine, [score])
    assert_as_alone(engine, stream)
    assert_greedy_as_reference(reference, stream)


def test_an_interactive_step_that_fails_leaves_the_batch_pass_whole(engine, monkeypatch):
    """A failure in an interactive step between blocks fails that step's requests (as any step's
    failure does); the batch pass it interrupted goes on, and its lines are answered as alone."""
    lines, asked = batch_lines(engine), interactive_requests(engine)[1:]
    original_step = engine.step

    def failing_step(plan):
        if any(g in asked for g in plan.groups):
            raise RuntimeError("injected failure of an interactive step")
        return original_step(plan)

    monkeypatch.setattr(engine, "step", failing_step)
    FirstBlock(engine).run(lines, asked, return_exceptions=True)
    monkeypatch.undo()
    assert isinstance(asked[0].error, RuntimeError)
    assert all(g.error is None and g.is_finished for g in lines)
    assert_as_uninterrupted(engine, lines)


def test_a_pass_that_fails_after_its_pauses_fails_its_own_groups(engine, reference, monkeypatch):
    """A batch pass that fails after it paused for interactive requests (here at its first pause point
    once they are answered) fails its own lines with the step it failed in: the interactive requests
    answered in the steps between keep their answers, as alone, and the engine scores the same lines
    again, each as the float64 reference does."""
    lines = batch_lines(engine)
    asked = [make(engine, "An interactive text to score", max_tokens=0, prompt_logprobs=2),
             make(engine, "An interactive question about rivers", max_tokens=2, temperature=0, logprobs=3)]
    original = engine.runner.prompt_pass

    def failing(groups, hits):
        steps = original(groups, hits)
        if not groups[0].is_batch:
            return (yield from steps)
        for positions in steps:
            if all(g.is_finished for g in asked):
                raise RuntimeError("injected failure of a batch pass")
            yield positions

    monkeypatch.setattr(engine.runner, "prompt_pass", failing)
    FirstBlock(engine).run(lines, asked, return_exceptions=True)
    monkeypatch.undo()
    assert all(isinstance(g.error, RuntimeError) for g in lines)
    assert all(g.error is None and g.is_finished for g in asked) and not engine.scheduler.passes
    assert engine.step_failures == 1 and engine.request_failures == 0
    for group in asked:
        assert_as_alone(engine, group)
    again = copies(lines, engine.table)
    asyncio.run(engine.run_groups(again))
    for group in again:
        assert group.error is None
        ref = reference.logprobs(group.prompt_ids).numpy()
        want = [ref[i - 1][group.prompt_ids[i]] for i in range(1, len(group.prompt_ids))]
        np.testing.assert_allclose(group.prompt_columns.logprobs[1:], want, atol=TOL)


def test_a_pass_that_fails_as_it_begins_fails_its_groups_once(engine, reference, monkeypatch):
    """A prompt-only pass whose runner fails as the pass begins (before its first block) leaves the
    scheduler and fails its own groups with that one step; the engine then scores the same texts, each as
    the float64 reference does."""
    lines = batch_lines(engine)

    def broken(groups, hits):
        raise RuntimeError("injected failure as a pass begins")

    monkeypatch.setattr(engine.runner, "prompt_pass", broken)

    async def main():
        return await asyncio.gather(*engine.submit(lines), return_exceptions=True)

    asyncio.run(main())
    monkeypatch.undo()
    assert all(isinstance(g.error, RuntimeError) for g in lines) and not engine.scheduler.passes
    assert engine.step_failures == 1 and engine.request_failures == 0
    again = copies(lines, engine.table)
    asyncio.run(engine.run_groups(again))
    for group in again:
        ref = reference.logprobs(group.prompt_ids).numpy()
        want = [ref[i - 1][group.prompt_ids[i]] for i in range(1, len(group.prompt_ids))]
        np.testing.assert_allclose(group.prompt_columns.logprobs[1:], want, atol=TOL)


def assert_as_uninterrupted(engine, lines: list[SequenceGroup]) -> None:
    again = copies(lines, engine.table)
    engine.runner.prefix_cache.clear()  # the first run kept the lines' blocks: the same pass, from nothing

    async def main():
        with gathered(engine):
            done = engine.submit(again)
        await asyncio.gather(*done)

    asyncio.run(main())
    for group, uninterrupted in zip(lines, again):
        assert numbers(uninterrupted) == numbers(group), group.request_id


def test_batch_lines_that_decode_go_on_in_the_interactive_steps(engine, reference):
    """Batch lines generating when a pass of batch scoring lines begins: an interactive step between the
    pass's blocks decodes them beside the interactive request (a decode pass takes every row of the KV
    cache), and every line ends with the float64 reference's greedy tokens and log probabilities."""
    generating = [make(engine, f"Batch generation {i}", "batch", max_tokens=6, temperature=0, logprobs=2)
                  for i in range(3)]
    lines, asked = batch_lines(engine), interactive_requests(engine)[1:]
    decoded_inside = []  # per interactive step: the batch rows it decoded
    holder = FirstBlock(engine)
    original_step = engine.step

    def step(plan):
        if holder.in_pass.is_set() and any(g in asked for g in plan.groups):
            decoded_inside.append(sum(g in generating for g in plan.decode))
        return original_step(plan)

    engine.step = step
    try:
        holder.run(generating + lines, asked)
    finally:
        del engine.step
    assert all(g.error is None and g.is_finished for g in generating + lines + asked)
    assert any(decoded_inside)  # an interactive step decoded batch rows beside the interactive one
    for group in generating + asked:
        assert_greedy_as_reference(reference, group)
    assert_as_uninterrupted(engine, lines)
