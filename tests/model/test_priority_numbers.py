"""An interactive request among batch lines (engine/host/scheduler.py's priorities) on the tiny random
model: its prompt goes ahead of the queued batch lines and its rows share the decode passes of the
running ones, and every number it reports is what it reports alone and what the float64 forward of the
same weights gives; the batch lines' numbers too."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from logprobe.engine.host.request import SamplingParams, SequenceGroup

TOL = 1e-5  # as tests/model/test_batching.py


def interactive(engine) -> SequenceGroup:
    ids = engine.tokenizer("The interactive question, asked while a batch runs").input_ids
    return SequenceGroup("interactive", ids, SamplingParams(max_tokens=10, temperature=0, logprobs=3, echo=True),
                         engine.table)


def batch_lines(engine, num: int) -> list[SequenceGroup]:
    """Batch lines of three kinds: sampled generations, greedy ones, and prompt-only echo scoring."""
    lines = []
    for i in range(num):
        ids = engine.tokenizer(f"batch line {i} " + "of a dataset " * (i % 5)).input_ids
        kind = i % 3
        params = (SamplingParams(max_tokens=24, temperature=0.9, seed=i, logprobs=2) if kind == 0 else
                  SamplingParams(max_tokens=24, temperature=0, logprobs=1) if kind == 1 else
                  SamplingParams(max_tokens=0, echo=True, logprobs=2))
        line = SequenceGroup(f"line-{i}", ids, params, engine.table)
        line.priority = "batch"
        lines.append(line)
    return lines


def check_against_reference(group: SequenceGroup, reference) -> None:
    ids = group.prompt_ids
    if group.params.echo:
        ref = reference.logprobs(ids).numpy()
        np.testing.assert_allclose(group.prompt_columns.logprobs[1:], [ref[i - 1][ids[i]] for i in range(1, len(ids))],
                                   atol=TOL)
    for seq in group.sequences:
        ref = reference.logprobs(ids + seq.token_ids).numpy()
        start = len(ids) - 1
        np.testing.assert_allclose(seq.logprobs, [ref[start + i][t] for i, t in enumerate(seq.token_ids)], atol=TOL)
        k = group.params.logprobs or 0
        if k and seq.token_ids:
            want_top = np.sort(ref[start:-1], axis=1)[:, ::-1][:len(seq.token_ids), :k]
            np.testing.assert_allclose(np.stack(seq.top_logprobs)[:, :k], want_top, atol=TOL)


def test_an_interactive_request_among_batch_lines_gives_its_numbers_alone(tiny_engine, reference):
    alone = interactive(tiny_engine)
    asyncio.run(tiny_engine.run_groups([alone]))

    lines = batch_lines(tiny_engine, 90)  # more than max_running: some wait while others decode
    among = interactive(tiny_engine)
    started, submitted = threading.Event(), threading.Event()
    beside: list[tuple[int, int]] = []  # (batch groups running, batch groups waiting) at each of its steps

    def first_line_step(group):  # the engine thread, after the batch's first step: wait for the request
        if not started.is_set():
            started.set()
            submitted.wait(timeout=300)

    lines[0].on_step = first_line_step
    among.on_step = lambda group: beside.append((sum(g.is_batch for g in tiny_engine.scheduler.running),
                                                 sum(g.is_batch for g in tiny_engine.scheduler.waiting)))

    async def both():
        line_futures = tiny_engine.submit(lines)
        await asyncio.to_thread(started.wait, 300)
        among_future = tiny_engine.submit([among])
        submitted.set()
        await asyncio.gather(*among_future, *line_futures)

    asyncio.run(both())
    assert submitted.is_set() and beside[0][1] > 0  # its prompt went ahead of batch lines still queued ...
    assert all(running > 0 for running, _ in beside)  # ... and its rows decoded beside the batch's rows
    assert all(line.is_finished and line.error is None for line in lines)

    assert among.sequences[0].token_ids == alone.sequences[0].token_ids
    np.testing.assert_allclose(among.sequences[0].logprobs, alone.sequences[0].logprobs, atol=TOL)
    np.testing.assert_allclose(np.stack(among.sequences[0].top_logprobs), np.stack(alone.sequences[0].top_logprobs),
                               atol=TOL)
    np.testing.assert_allclose(among.prompt_columns.logprobs[1:], alone.prompt_columns.logprobs[1:], atol=TOL)
    np.testing.assert_array_equal(among.prompt_columns.top_ids[1:], alone.prompt_columns.top_ids[1:])
    check_against_reference(among, reference)
    for line in lines[:9]:  # the batch lines' numbers too (each kind, three times)
        check_against_reference(line, reference)
