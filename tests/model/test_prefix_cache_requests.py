"""The prefix cache (engine/runners/prefix_cache.py) for every kind of request: a generation's prompt starts after
its longest kept prefix and keeps its own blocks, a finished generation keeps its prompt and what it
generated, a prompt-only batch and a generation find each other's. A client that picks every token
itself (one request a token, `max_tokens` 1, its prompt the ids so far) runs one token through the blocks
a call. Whatever ran before, every number equals the engine without the cache (float32 rounding) and the
float64 reference; the bytes held never pass the bound, and the runner keeps no record of a finished
request.

Engines run step by step on the test's own thread (test_kv_memory.drive), tiny random-weight float32
models: Llama, and Gemma 3 / Mistral with a sliding window (12) shorter than the kept prefixes.
"""

from __future__ import annotations

import numpy as np
import pytest

from logprobe.engine.runners.prefix_cache import BLOCK, PrefixCache
from logprobe.engine.host.request import SamplingParams, SequenceGroup
from test_prefix_cache import check_reference, engines, same_columns  # noqa: F401 (engines: a fixture)

TOL = 1e-5


def prompt(length: int, salt: int = 0) -> list[int]:
    gen = np.random.default_rng(7919 * salt + length)
    return [1] + [int(t) for t in gen.integers(3, 40_000, length - 1)]


def drive(engine, groups):
    """Run `groups` to their end a step at a time (the loop's own checks after each step)."""
    scheduler = engine.scheduler
    for group in groups:
        scheduler.add(group)
    while scheduler.has_work:
        plan = scheduler.schedule()
        engine._finish_dropped()
        if plan is not None:
            engine.step(plan)
        assert engine.kv.is_consistent(scheduler.running) and engine.runner.is_consistent(scheduler.running)
    assert all(g.error is None and g.is_finished for g in groups)
    assert not engine.runner.records and not engine.kv.rows  # nothing kept of a finished request
    return groups


def run(engine, ids, **params):
    group, = drive(engine, [SequenceGroup("t", list(ids), SamplingParams(**params), engine.table)])
    return group


def counting(engine, monkeypatch) -> list:
    """The tokens each pass of the blocks runs."""
    passes = []
    forward = engine.runner._embed  # every pass of the blocks begins here (`forward`, `forward_steps`)

    def counted(ids, meta, *args, **kwargs):
        passes.append(ids.numel())
        return forward(ids, meta, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "_embed", counted)
    return passes


def same_tokens(a: SequenceGroup, b: SequenceGroup) -> None:
    for x, y in zip(a.sequences, b.sequences, strict=True):
        assert x.token_ids == y.token_ids
        assert np.abs(np.asarray(x.logprobs) - np.asarray(y.logprobs)).max() < TOL
        if x.top_logprobs:
            assert np.abs(np.stack(x.top_logprobs) - np.stack(y.top_logprobs)).max() < TOL


def against_reference(reference, ids: list[int], group: SequenceGroup) -> None:
    """Each generated token's log probability and top-k against the float64 forward of its context."""
    for seq in group.sequences:
        context = ids + seq.token_ids
        ref = reference.logprobs(context).numpy()
        for i, token in enumerate(seq.token_ids):
            row = ref[len(ids) - 1 + i]
            assert abs(seq.logprobs[i] - row[token]) < TOL
            if seq.top_logprobs:
                want = np.sort(row)[::-1][:len(seq.top_logprobs[i])]
                assert np.abs(seq.top_logprobs[i] - want).max() < TOL


@pytest.mark.parametrize("kind", ["llama", "gemma3", "mistral"])
def test_a_client_loop_runs_one_token_a_call(kind, engines, reference_of, monkeypatch):
    """One request a token, as a client that picks each token itself sends them: after the first call
    each runs one token through the blocks (the kept blocks, and the tokens the call before wrote past
    them), crossing several block boundaries and the sliding window; every answer as without the cache
    and as the reference's. Calls that also ask for the prompt's log probabilities read the kept
    prefix's hidden states: their columns equal the uncached engine's."""
    model, cached, uncached = engines(kind)
    reference = reference_of(model)
    cached.runner.prefix_cache.clear()
    passes = counting(cached, monkeypatch)
    ids = prompt(29, salt=1)
    for call in range(40):
        passes.clear()
        with_columns = call % 9 == 4
        params = dict(max_tokens=1, logprobs=3, temperature=0, **({"prompt_logprobs": 2} if with_columns else {}))
        a, b = run(cached, ids, **params), run(uncached, ids, **params)
        same_tokens(a, b)
        if with_columns:
            same_columns(a.prompt_columns, b.prompt_columns)
            check_reference(reference, ids, a.prompt_columns)
        if call % 5 == 0:
            against_reference(reference, ids, a)
        assert passes == ([len(ids)] if call == 0 else [1]), call
        ids = ids + a.sequences[0].token_ids
    cache = cached.runner.prefix_cache
    assert cache.hits == 39 and len(cache) == 1 and 0 < cache.nbytes <= cache.max_bytes
    assert cache.tokens_saved == sum(range(29, 68))  # every token but the last of each call's prompt


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_a_finished_generation_is_found_by_the_next_turn(kind, engines, reference_of, monkeypatch):
    """A conversation's next turn: the prompt of the turn before, what it generated and new text. The
    turn before's keys and values (its prompt and its generated tokens, n of 2 choices: the first's)
    are kept when it finishes, so the next turn runs only from the last whole block on; sampled and
    greedy, every number as without the cache and as the reference's."""
    model, cached, uncached = engines(kind)
    reference = reference_of(model)
    cached.runner.prefix_cache.clear()
    passes = counting(cached, monkeypatch)
    ids = prompt(23, salt=2)
    first = dict(max_tokens=30, logprobs=2, temperature=1.0, seed=5, n=2)
    a, b = run(cached, ids, **first), run(uncached, ids, **first)
    same_tokens(a, b)
    against_reference(reference, ids, a)
    generated = a.sequences[0].token_ids
    follow = ids + generated + prompt(9, salt=3)[1:]
    kept = (len(ids) + len(generated) - 1) // BLOCK * BLOCK  # the last token generated never ran
    passes.clear()
    c, d = run(cached, follow, max_tokens=6, logprobs=2, temperature=0), run(uncached, follow, max_tokens=6, logprobs=2, temperature=0)
    assert passes[0] == len(follow) - kept  # the first pass: the prompt after the kept blocks
    same_tokens(c, d)
    against_reference(reference, follow, c)
    # echo on a hit of the generation's entry: the prompt part's hidden states were kept, the
    # generated part's were not, so the hit stops where they do; the columns are right either way
    passes.clear()
    e = run(cached, follow, max_tokens=1, prompt_logprobs=1)
    f = run(uncached, follow, max_tokens=1, prompt_logprobs=1)
    same_columns(e.prompt_columns, f.prompt_columns)
    check_reference(reference, follow, e.prompt_columns)
    assert passes[0] < len(follow)


def test_prompt_only_and_generation_requests_share_the_cache(engines, reference_of, monkeypatch):
    """A scored text's blocks serve a generation's prompt, and a generation's serve a scored text and
    a batch of two prompts: each runs only past the kept prefix, with the uncached engine's numbers."""
    model, cached, uncached = engines("gemma3")
    reference = reference_of(model)
    cached.runner.prefix_cache.clear()
    passes = counting(cached, monkeypatch)
    context = prompt(40, salt=4)
    scored = dict(max_tokens=0, prompt_logprobs=2)
    assert run(cached, context + [77], **scored).num_cached_tokens == 0  # the cache was empty
    passes.clear()
    gen = run(cached, context + [88, 99], max_tokens=4, logprobs=1, temperature=0)
    assert passes[0] == len(context) + 2 - 32
    # usage's cached_tokens: the prompt tokens no pass ran
    assert gen.num_cached_tokens == gen.output().num_cached_tokens == 32
    alone = run(uncached, context + [88, 99], max_tokens=4, logprobs=1, temperature=0)
    same_tokens(gen, alone)
    assert alone.num_cached_tokens == 0
    texts = [context + [88, 99] + gen.sequences[0].token_ids[:2] + [5], context + [1234, 5]]
    passes.clear()
    groups = drive(cached, [SequenceGroup(f"s{i}", t, SamplingParams(**scored), cached.table)
                            for i, t in enumerate(texts)])
    assert sum(passes) < sum(len(t) for t in texts)
    assert all(g.num_cached_tokens % BLOCK == 0 and g.num_cached_tokens < len(t) for g, t in zip(groups, texts))
    for text, group in zip(texts, groups):
        same_columns(group.prompt_columns, run(uncached, text, **scored).prompt_columns)
        check_reference(reference, text, group.prompt_columns)


def test_two_requests_extending_one_entry_in_one_step(engines, reference_of):
    """Two prompts going on from the same kept prefix in one step: one writes on in the kept store, the
    other copies it (nobody writes where another reads); then both continue as client loops of their
    own. Every answer as without the cache."""
    model, cached, uncached = engines("llama")
    cached.runner.prefix_cache.clear()
    base = prompt(33, salt=5)
    run(cached, base, max_tokens=1)
    branches = [base + [101], base + [202]]
    for _ in range(20):
        groups = drive(cached, [SequenceGroup(f"b{i}", ids, SamplingParams(max_tokens=1, logprobs=2, temperature=0), cached.table)
                                for i, ids in enumerate(branches)])
        for ids, group in zip(branches, groups):
            same_tokens(group, run(uncached, ids, max_tokens=1, logprobs=2, temperature=0))
        branches = [ids + g.sequences[0].token_ids for ids, g in zip(branches, groups)]
    cache = cached.runner.prefix_cache
    assert cache.nbytes <= cache.max_bytes and len(cache) >= 2


def test_the_bound_holds_and_numbers_stay_under_eviction(engines, reference_of):
    """A bound of about one long sequence: client loops of three texts, two calls each in turn: the
    second call of a text hits, the next text's evicts it, the bytes held never pass the bound, and
    every answer is the uncached engine's."""
    model, cached, uncached = engines("mistral")
    runner = cached.runner
    per_token = len(runner.layers) * 2 * runner.kv_heads * runner.head_dim * 4 + runner.hidden_size * 4
    saved = cached.use_prefix_cache(cache := PrefixCache(int(100 * per_token)))
    try:
        texts = [prompt(50, salt=10 + i) for i in range(3)]
        for step in range(30):
            i = step // 2 % 3
            a = run(cached, texts[i], max_tokens=1, logprobs=2, temperature=0)
            same_tokens(a, run(uncached, texts[i], max_tokens=1, logprobs=2, temperature=0))
            texts[i] = texts[i] + a.sequences[0].token_ids
            assert 0 < cache.nbytes <= cache.max_bytes
        assert cache.hits >= 10 and cache.misses >= 10
    finally:
        cached.use_prefix_cache(saved)


def test_an_aborted_prompt_leaves_the_cache_right(engines):
    """A prompt aborted between its chunks leaves what it wrote past the kept entry: the same prompt
    again, and another that parts from it, get the uncached engine's numbers."""
    model, cached, uncached = engines("llama")
    runner = cached.runner
    runner.prefix_cache.clear()
    base = prompt(40, salt=6)
    run(cached, base, max_tokens=1)
    long = base + prompt(30, salt=7)[1:]
    group = SequenceGroup("a", long, SamplingParams(max_tokens=3), cached.table)
    scheduler = cached.scheduler
    scheduler.add(group)
    plan = scheduler.schedule()
    plan.prefill = [plan.prefill[0]._replace(num_tokens=5)]  # a chunk of 5 tokens, then aborted
    cached.step(plan)
    group.is_aborted = True
    scheduler.schedule()
    cached._finish_dropped()
    assert not runner.records
    for ids in (long, long[:45] + [9, 9, 9]):
        same_tokens(run(cached, ids, max_tokens=3, logprobs=2, temperature=0),
                    run(uncached, ids, max_tokens=3, logprobs=2, temperature=0))


def test_interventions_neither_use_nor_fill_it_in_generations(engines):
    """A generation with interventions runs a modified pass: it looks nothing up and keeps nothing."""
    _, cached, _ = engines("llama")
    cache = cached.runner.prefix_cache
    cache.clear()
    ids = prompt(40, salt=8)
    from logprobe.backend import Intervention

    edit = (Intervention(layer=1, op="add", vector=np.ones(64, dtype=np.float32) * 0.1),)
    counts = (cache.hits, cache.misses)
    run(cached, ids, max_tokens=3, interventions=edit)
    assert (len(cache), cache.hits, cache.misses) == (0, *counts)
    run(cached, ids, max_tokens=3)
    assert len(cache) == 1
    hits = cache.hits
    run(cached, ids, max_tokens=3, interventions=edit)
    assert cache.hits == hits and len(cache) == 1


def test_stats_report_the_counts(engines):
    _, cached, _ = engines("llama")
    cached.runner.prefix_cache.clear()
    ids = prompt(40, salt=9)
    run(cached, ids, max_tokens=1)
    before = cached.stats()
    run(cached, ids + [5], max_tokens=1)
    after = cached.stats()
    assert after["prefix_cache_hits"] == before["prefix_cache_hits"] + 1
    assert after["prefix_cache_tokens_saved"] == before["prefix_cache_tokens_saved"] + 40
    assert after["prefix_cache_bytes"] == cached.runner.prefix_cache.nbytes > 0


def test_a_token_tree_finds_and_fills_the_cache(engines, reference_of, monkeypatch):
    """A token tree's prompt starts after its longest kept prefix and leaves its own blocks: the same
    tree twice (the second runs its prompt's last token only, then its levels), and a generation after
    it; every node's log probability as without the cache and as the reference's at its path."""
    from logprobe.backend import TreeShape
    from logprobe.engine.host.tree import TreeGroup

    model, cached, uncached = engines("gemma3")
    reference = reference_of(model)
    cached.runner.prefix_cache.clear()
    passes = counting(cached, monkeypatch)
    ids = prompt(35, salt=12)

    def tree(engine):
        group = TreeGroup("tree", list(ids), SamplingParams(max_tokens=2, temperature=1.0), engine.table,
                          TreeShape(depth=2, branches=3))
        drive(engine, [group])
        return group

    first = tree(cached)
    passes.clear()
    again, plain = tree(cached), tree(uncached)
    assert passes[0] == len(ids) - 32  # the prompt after its two kept blocks
    want = plain.output().tree
    for group in (first, again):
        t = group.output().tree
        assert list(t.token_ids) == list(want.token_ids) and list(t.parents) == list(want.parents)
        assert np.abs(np.asarray(t.logprobs) - np.asarray(want.logprobs)).max() < TOL
    t = again.output().tree
    for parent, token, logprob in zip(t.parents, t.token_ids, t.logprobs):
        path = ids + (again.path(int(parent)) if parent >= 0 else [])
        assert abs(logprob - reference.logprobs(path).numpy()[-1][token]) < TOL
    passes.clear()
    gen = run(cached, ids + [5, 6], max_tokens=2, temperature=0)
    assert passes[0] == 5  # the tree's kept blocks, then its own 5 tokens
    against_reference(reference, ids + [5, 6], gen)
