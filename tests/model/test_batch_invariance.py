"""A request's numbers have the same bits whatever runs beside it (lean runner, float32): a generation
run alone, then arriving while others decode; a scored text and a generation's prompt numbers beside
requests of every kind, with and without the prefix cache, prompts cut into chunks where the step's
budget falls; rows past 256 positions beside longer ones; a prompt after a kept generation. Compared
bit for bit (tokens, log probabilities, ranks, top-k ids and values, asked ids, statistics), for a family
with full attention (Llama) and two with sliding windows (Mistral, Gemma 3); the values themselves
against the float64 forward.

What makes it hold: torch's float32 products are row-invariant under MKL's strict reproducibility mode
(set on import, logprobe/__init__.py), and every pass reads keys to `Attention.aligned` of the positions
it holds, at which SDPA gives a query the same bits whatever the read and whichever form the call takes
(test_attention_reads.py; benchmarks/row_invariance.py measures both).

Slow: a family's prompt test runs 190 requests of every kind (up to 300 tokens, prompts prefilled in
chunks of 40 next to decoding rows, each position's ranks over a 49,152-token vocabulary), half of them
with the prefix cache, and compares every number of its probes: 16-20 s a family on 2 vCPUs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from logprobe.engine.host.request import SamplingParams, SequenceGroup
from logprobe.engine.runners.lean.attention import Attention
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


# ---- the prompt's own numbers ---------------------------------------------------------------------
SCORED = dict(max_tokens=0, echo=True, prompt_logprobs=5, logprob_token_ids=(5, 9, 100), position_stats=True)


def prompt_probes(engine):
    """A scored text (prompt-only: the prompt batch's passes) and a generation that asks for its prompt's
    numbers (prefilled in chunks, next to decoding rows)."""
    return [SequenceGroup("scored", prompt(150, 3), SamplingParams(**SCORED), engine.table),
            SequenceGroup("prompted", prompt(120, 4), SamplingParams(max_tokens=10, logprobs=5, prompt_logprobs=3,
                                                                     temperature=0), engine.table)]


def mixed(engine, count: int, rng) -> list[SequenceGroup]:
    """`count` requests of every kind: scored texts, some beginning with the scored probe's first 16-80
    tokens (a prefix the batch shares, or the cache keeps), generations with and without their prompt's
    numbers, greedy and sampled, of 3-300 tokens."""
    out, head = [], prompt(150, 3)
    for i in range(count):
        kind, length = int(rng.integers(4)), int(rng.integers(3, 300))
        ids = prompt(length, 200 + i)
        if kind == 0:
            params = SamplingParams(max_tokens=0, echo=True, prompt_logprobs=int(rng.integers(0, 4)))
        elif kind == 1:
            ids = head[:int(rng.integers(16, 80))] + ids[1:]
            params = SamplingParams(**SCORED)
        else:
            sampled = bool(rng.integers(2))
            params = SamplingParams(max_tokens=int(rng.integers(4, 24)), logprobs=int(rng.integers(0, 6)),
                                    prompt_logprobs=2 if kind == 3 else None, temperature=0.9 if sampled else 0.0,
                                    seed=int(rng.integers(1000)) if sampled else None)
        out.append(SequenceGroup(f"mixed{i}", ids, params, engine.table))
    return out


def whole_answer(group: SequenceGroup) -> list[np.ndarray]:
    """Every number the group's answer holds: its prompt's columns (with the asked ids and statistics),
    and its generated tokens with theirs."""
    cols, out = group.prompt_columns, []
    for name in ("logprobs", "ranks", "top_ids", "top_logprobs"):
        out.append(getattr(cols, name))
    out += [a for a in vars(cols.extras).values() if isinstance(a, np.ndarray)] if cols.extras is not None else []
    if group.params.max_tokens:
        seq = group.sequences[0]
        out += [np.asarray(seq.token_ids), np.asarray(seq.logprobs), np.stack(seq.top_logprobs), np.stack(seq.top_ids)]
    return out


def assert_same_arrays(alone: list[np.ndarray], beside: list[np.ndarray], where: str) -> None:
    assert len(alone) == len(beside), where
    for a, b in zip(alone, beside):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert np.array_equal(a, b, equal_nan=True), (where, np.nanmax(np.abs(a.astype(float) - b)))


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma3"])
def test_a_prompts_numbers_have_the_same_bits_beside_anything(kind, engines, reference_of, monkeypatch):
    """A scored text and a generation's prompt, run alone on the engine without a prefix cache, then beside
    1, 7, 24 and 63 requests of every kind (arriving in the same step, or while the others run), on that
    engine and on one whose prefix cache holds whatever the runs before left (the probes' own prompts,
    prefixes of them): every number of both answers the same bits. Prompts are prefilled in chunks of
    at most 40 tokens next to decoding rows, so where a chunk ends depends on what shares its step."""
    model, cached, uncached = engines(kind)
    with torch.inference_mode():
        alone = prompt_probes(uncached)
        for group in alone:
            drive(uncached, [group])
        want = [whole_answer(g) for g in alone]
        cached.runner.prefix_cache.clear()
        rng = np.random.default_rng(17)
        for engine in (uncached, cached):
            monkeypatch.setattr(engine.scheduler, "prefill_chunk_tokens", 40)
            for count in (1, 7, 24, 63):
                mine = prompt_probes(engine)
                if rng.integers(2):
                    drive(engine, mixed(engine, count, rng) + mine)
                else:
                    drive(engine, mixed(engine, count, rng), later=mine, after=int(rng.integers(1, 4)))
                for group, expected in zip(mine, want):
                    assert_same_arrays(expected, whole_answer(group),
                                       f"{kind}: {group.request_id} beside {count} ({engine.info.name})")
        assert cached.runner.prefix_cache.hits > 0
    # and the numbers themselves are the float64 forward's
    reference = reference_of(model)
    ids = prompt(150, 3)
    ref = reference.logprobs(ids).numpy()
    got = alone[0].prompt_columns.logprobs[1:]
    np.testing.assert_allclose(got, [ref[i][t] for i, t in enumerate(ids[1:])], atol=TOL)


def test_long_rows_have_the_same_bits_beside_longer_ones(tokenizer, reference_of):
    """From 257 to 512 positions a row reads 512 (`Attention.aligned`): a generation whose rows pass
    from 280 to 300 positions and a 330-token scored text, alone and then beside requests of up to 500
    tokens (so the longest row of the pass, and its read, changes under them), have the same bits. The
    tiny models of the other tests hold 256 positions; this Llama holds 1,024."""
    import transformers as tf

    from logprobe.engine.engine import Engine
    from test_families import COMMON

    torch.manual_seed(3)
    config = tf.LlamaConfig(vocab_size=len(tokenizer), num_hidden_layers=2, **{**COMMON, "max_position_embeddings": 1024})
    model = tf.LlamaForCausalLM(config).eval()
    engine = Engine(model, tokenizer, "llama-1024", [], prefix_cache_mb=0)

    def mine():
        return [SequenceGroup("long", prompt(280, 5), SamplingParams(max_tokens=20, logprobs=4, temperature=0),
                              engine.table),
                SequenceGroup("long-scored", prompt(330, 6), SamplingParams(**SCORED), engine.table)]

    def longer(count, rng):
        return [SequenceGroup(f"longer{i}", prompt(int(rng.integers(250, 480)), 300 + i),
                              SamplingParams(max_tokens=int(rng.integers(5, 25)), temperature=0), engine.table)
                for i in range(count)]

    with torch.inference_mode():
        alone = mine()
        for group in alone:
            drive(engine, [group])
        want = [whole_answer(g) if g.params.max_tokens == 0 else list(answer(g)[1:]) for g in alone]
        rng = np.random.default_rng(23)
        for count in (1, 6):
            beside = mine()
            drive(engine, longer(count, rng), later=beside, after=2)
            for group, expected in zip(beside, want):
                got = whole_answer(group) if group.params.max_tokens == 0 else list(answer(group)[1:])
                assert_same_arrays(expected, got, f"{group.request_id} beside {count}")
    ids = prompt(330, 6)
    ref = reference_of(model).logprobs(ids).numpy()
    np.testing.assert_allclose(alone[1].prompt_columns.logprobs[1:], [ref[i][t] for i, t in enumerate(ids[1:])], atol=TOL)


@pytest.mark.skipif(not Attention.invariant_kernels(), reason=(
    f"torch {torch.__version__}: its CPU attention gives a decode row other bits than a prompt pass "
    f"(test_attention_reads.py)"))
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_a_prompt_after_a_generation_has_the_same_bits_from_the_decode_steps_keys(kind, engines):
    """A client's loop: a generation, then its prompt and generated text sent back with more tokens. The
    prefix cache holds the first call's keys, those of its generated tokens made by decode steps (one
    query a row, read over the slab), and the second call's prompt starts after them: its numbers are
    those of the engine without a cache, which computes every key in a prompt pass."""
    _, cached, uncached = engines(kind)
    cached.runner.prefix_cache.clear()
    with torch.inference_mode():
        first = SequenceGroup("first", prompt(40, 8), SamplingParams(max_tokens=30, temperature=0), cached.table)
        drive(cached, [first])
        ids = prompt(40, 8) + list(first.sequences[0].token_ids) + prompt(20, 9)[1:]
        answers, saved = [], cached.runner.prefix_cache.tokens_saved
        for engine in (cached, uncached):
            # no prompt_logprobs: a hit that must give its positions' numbers needs their hidden states,
            # which a decode step does not keep
            second = SequenceGroup("second", ids, SamplingParams(max_tokens=8, logprobs=3, temperature=0), engine.table)
            drive(engine, [second])
            answers.append(list(answer(second)[1:]))
        assert cached.runner.prefix_cache.tokens_saved - saved >= 64  # it started after the kept keys
    assert_same_arrays(answers[1], answers[0], f"{kind}: after the kept generation")
