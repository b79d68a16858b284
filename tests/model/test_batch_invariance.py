"""A request's decode steps give the same bits whatever decodes beside it: a generation run alone, then
arriving while 1, 5 or 16 other requests of random lengths and settings are decoding, has the same tokens,
log probabilities and top-k (ids and values) bit for bit, on the lean runner, float32, for a family with
full attention (Llama) and two with sliding windows (Mistral, Gemma 3).

What makes it hold: torch's float32 products are row-invariant under MKL's strict reproducibility mode
(set on import, logprobe/__init__.py), and attention reads each slab in spans of whole
`Attention.READ_ALIGN` positions, so where a row's keys fall in SDPA's vector/tail split does not depend
on the longest row beside it (benchmarks/row_invariance.py measures both). The prompt's own pass is not
covered here: prompts prefilled in one pass with other prompts still differ in the last bits. The prefix
cache is off so that the probe's prompt runs the same pass each time."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from logprobe.engine.host.request import SamplingParams, SequenceGroup
from test_prefix_cache import engines  # noqa: F401 (a fixture: kind -> (model, cached engine, uncached))

TOL = 1e-5


def prompt(length: int, salt: int) -> list[int]:
    gen = np.random.default_rng(7919 * salt + length)
    return [1] + [int(t) for t in gen.integers(3, 40_000, length - 1)]


def drive(engine, groups, later=(), after=0):
    """Run `groups` a step at a time; each of `later` is added once `after` steps have run and no other
    prompt waits or is being prefilled (its prompt then runs in a pass of its own, or beside decode rows)."""
    scheduler, steps, later, everyone = engine.scheduler, 0, list(later), [*groups, *later]
    for group in groups:
        scheduler.add(group)
    while scheduler.has_work or later:
        if later and steps >= after and not scheduler.has_prompts_to_admit:
            scheduler.add(later.pop(0))
        plan = scheduler.schedule()
        engine._finish_dropped()
        if plan is not None:
            engine.step(plan)
        steps += 1
    assert all(g.error is None and g.is_finished for g in everyone)


def probes(engine):
    return [SequenceGroup("greedy", prompt(30, 1), SamplingParams(max_tokens=20, logprobs=5, temperature=0), engine.table),
            SequenceGroup("sampled", prompt(45, 2), SamplingParams(max_tokens=20, logprobs=3, temperature=0.8, seed=11),
                          engine.table)]


def others(engine, count: int, rng) -> list[SequenceGroup]:
    out = []
    for i in range(count):
        sampled = bool(rng.integers(2))
        params = SamplingParams(max_tokens=int(rng.integers(8, 40)), logprobs=int(rng.integers(0, 6)),
                                temperature=0.9 if sampled else 0.0, seed=int(rng.integers(1000)) if sampled else None)
        out.append(SequenceGroup(f"other{i}", prompt(int(rng.integers(3, 150)), 100 + i), params, engine.table))
    return out


def answer(group: SequenceGroup):
    seq = group.sequences[0]
    return seq.token_ids, np.asarray(seq.logprobs), np.stack(seq.top_logprobs), np.stack(seq.top_ids)


def assert_same_bits(alone, beside, where: str) -> None:
    assert alone[0] == beside[0], where
    for a, b in zip(alone[1:], beside[1:]):
        assert a.dtype == b.dtype and np.array_equal(a, b), (where, np.abs(a.astype(float) - b).max())


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma3"])
def test_a_generation_has_the_same_bits_beside_any_decoding(kind, engines, reference_of):
    model, _, engine = engines(kind)  # without the prefix cache: the probe's prompt runs the same pass each time
    with torch.inference_mode():
        alone = probes(engine)
        for group in alone:
            drive(engine, [group])
        alone = [answer(g) for g in alone]
        rng = np.random.default_rng(5)
        for count in (1, 5, 16):
            mine = probes(engine)
            drive(engine, others(engine, count, rng), later=mine, after=int(rng.integers(1, 6)))
            for group, want in zip(mine, alone):
                assert_same_bits(want, answer(group), f"{kind}: {group.request_id} beside {count}")
    # and the numbers themselves are the float64 forward's
    reference = reference_of(model)
    ids, logprobs = prompt(30, 1), alone[0][1]
    ref = reference.logprobs(ids + alone[0][0]).numpy()
    got = [ref[len(ids) - 1 + i][t] for i, t in enumerate(alone[0][0])]
    np.testing.assert_allclose(logprobs, got, atol=TOL)
