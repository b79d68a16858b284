"""The prefix cache (engine/host/prefix_index.py, its memory engine/runners/prefix_cache.py): prompt prefixes' keys, values and hidden states kept across
batches of prompt-only groups, so the answers of one question sent in different batches (as
lm-evaluation-harness's length sorting sends them) run the context through the blocks once. Every column
must be what an engine without the cache gives, and the float64 reference's, with sliding windows
shorter than the kept prefix, under eviction, with every hash colliding, beside groups with
interventions (which neither use nor seed it); a bound of 0 turns it off. Unit tests of the cache's
own bookkeeping first."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from logprobe.engine.host import prefix_index
from logprobe.engine.engine import Engine
from logprobe.engine.runners.lean.attention import Attention
from logprobe.engine.runners.prefix_cache import BLOCK, PrefixCache
from logprobe.engine.host.request import SamplingParams, SequenceGroup
from test_families import WINDOW, build

TOL = 1e-5
LAYERS, KV, D, HIDDEN = 2, 2, 4, 8


# ---- the cache itself ------------------------------------------------------------------------------
def tensors(ids: list[int], layers: int = LAYERS):
    """Keys, values and hidden states whose every entry names its token (so a wrong slice shows)."""
    t = torch.tensor(ids, dtype=torch.float32)
    keys = [t[None, :, None].expand(KV, -1, D) * (layer + 1) for layer in range(layers)]
    values = [-k for k in keys]
    return keys, values, t[:, None].expand(-1, HIDDEN).clone()


def entry_bytes(m: int) -> int:
    return 4 * m * (2 * LAYERS * KV * D + HIDDEN)


def test_lookup_finds_the_longest_whole_blocks_that_leave_a_token():
    cache = PrefixCache(1 << 20)
    ids = list(range(1000, 1040))
    assert cache.insert(ids, *tensors(ids))  # kept: 32 tokens, two whole blocks
    assert len(cache) == 1 and cache.nbytes == entry_bytes(32)
    length, keys, values, hidden = cache.lookup(ids[:33])
    assert length == 32 and keys[1].shape == (KV, 32, D) and hidden.shape == (32, HIDDEN)
    assert torch.equal(keys[1][0, :, 0], 2 * torch.tensor(ids[:32], dtype=torch.float32))
    assert torch.equal(values[0][1, :, 3], -torch.tensor(ids[:32], dtype=torch.float32))
    assert cache.lookup(ids[:32])[0] == 16  # the prompt keeps its last token
    assert cache.lookup(ids[:20] + [7] * 20)[0] == 16  # differs inside the second block
    assert cache.lookup(ids[:17])[0] == 16
    assert cache.lookup(ids[:16]) is None and cache.lookup([5] + ids[1:]) is None
    assert (cache.hits, cache.misses) == (4, 2)


def test_insert_copies_skips_what_is_held_and_replaces_what_it_holds():
    cache = PrefixCache(1 << 20)
    ids = list(range(50, 90))
    keys, values, hidden = tensors(ids)
    batch = torch.stack(keys)  # a view of a batch tensor is copied, not held
    assert cache.insert(ids[:20], list(batch), values, hidden)
    batch.zero_()
    assert cache.lookup(ids)[1][0].abs().sum() > 0
    assert cache.nbytes == entry_bytes(16)
    entry = next(iter(cache.entries))
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size()
               for t in [*entry.store.keys, *entry.store.values, entry.store.hidden])
    assert not cache.insert(ids[:10], *tensors(ids[:10]))  # shorter than a block
    assert not cache.insert(ids[:31], *tensors(ids[:31]))  # the same whole block: held
    assert cache.insert(ids, *tensors(ids))  # 32 tokens: holds the 16 whole, which goes
    assert len(cache) == 1 and cache.nbytes == entry_bytes(32)
    assert not cache.insert(ids[:16], *tensors(ids[:16]))
    other = ids[:16] + [1] * 16  # shares the first block only: both are kept
    assert cache.insert(other, *tensors(other))
    assert len(cache) == 2 and cache.nbytes == 2 * entry_bytes(32)
    assert cache.lookup(other + [2])[0] == 32 and cache.lookup(ids[:16] + [3] * 5)[0] == 16
    assert cache.branches(ids[:16] + [3] * 20, 16) and not cache.branches(ids + [3] * 20, 32)
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0 and cache.lookup(ids) is None


def test_least_recently_used_goes_first_and_nothing_exceeds_the_bound():
    prompts = [[p] * 32 for p in (1, 2, 3)]
    cache = PrefixCache(2 * entry_bytes(32))
    for ids in prompts[:2]:
        assert cache.insert(ids, *tensors(ids))
    assert cache.lookup(prompts[0] + [9])  # the first is now the more recent
    assert cache.insert(prompts[2], *tensors(prompts[2]))
    assert cache.nbytes == 2 * entry_bytes(32) <= cache.max_bytes
    assert cache.lookup(prompts[1] + [9]) is None
    assert cache.lookup(prompts[0] + [9])[0] == 32 and cache.lookup(prompts[2] + [9])[0] == 32
    big = list(range(100, 180))  # 80 tokens: larger than the whole bound, not kept
    assert not cache.insert(big, *tensors(big))
    assert len(cache) == 2 and cache.nbytes <= cache.max_bytes


def test_a_hash_collision_never_gives_a_wrong_prefix(monkeypatch):
    monkeypatch.setattr(prefix_index, "block_hash", lambda previous, block: 0)  # every prefix collides
    cache = PrefixCache(1 << 20)
    a, b = list(range(10, 42)), list(range(10, 26)) + list(range(200, 216))
    assert cache.insert(a, *tensors(a))
    assert cache.lookup(list(range(300, 340))) is None  # same hashes, other tokens
    length, keys, _, hidden = cache.lookup(b + [1])  # same hashes, first block only in common
    assert length == 16 and torch.equal(hidden[:, 0], torch.tensor(a[:16], dtype=torch.float32))
    assert cache.insert(b, *tensors(b))  # not taken for `a`'s entry, which it collides with
    length, keys, _, _ = cache.lookup(b + [1])
    assert length == 32 and torch.equal(keys[0][0, :, 0], torch.tensor(b, dtype=torch.float32))
    assert cache.lookup(a + [1])[0] == 32 and len(cache) == 2


def test_a_bound_of_zero_turns_it_off():
    cache = PrefixCache(0)
    ids = list(range(40))
    assert not cache.enabled and not cache.insert(ids, *tensors(ids))
    assert cache.lookup(ids) is None and (len(cache), cache.nbytes, cache.hits, cache.misses) == (0, 0, 0, 0)
    with pytest.raises(ValueError):
        PrefixCache(-1)


# ---- through the lean runner -----------------------------------------------------------------------
SETTINGS = [dict(max_tokens=0, prompt_logprobs=3, echo=True), dict(max_tokens=0, prompt_logprobs=-1),
            dict(max_tokens=0, prompt_logprobs=2, logprob_token_ids=[5, 9, 100], position_stats=True,
                 top_logprobs_p=0.5)]
CONTEXT = ("Passage: the keeper of the old lighthouse wrote down every ship that passed, and the weather "
           "of each day. Question: what did the keeper write down? Answer:")
ANSWERS = (" the ships", " the weather and every ship that passed by in the night, each with its name and its "
           "flag", " nothing", " a letter")


def prompts_of(tokenizer, context: str = CONTEXT, answers=ANSWERS) -> list[list[int]]:
    ctx = tokenizer(context).input_ids
    return [ctx + tokenizer(a, add_special_tokens=False).input_ids for a in answers]


def columns(engine, prompts, params, interventions=()):
    groups = [SequenceGroup(f"s{i}", ids, SamplingParams(**params, interventions=interventions), engine.table)
              for i, ids in enumerate(prompts)]
    with torch.inference_mode():
        engine.runner.prefill_batch(groups)
    return [engine.runner.prompt_columns(g) for g in groups]


def counting(engine, monkeypatch) -> dict:
    """Count the tokens (real and padded) the passes of the blocks run."""
    counted = {"tokens": 0}
    forward = engine.runner._embed  # every pass of the blocks begins here (`forward`, `forward_steps`)

    def counted_forward(ids, meta, *args, **kwargs):
        counted["tokens"] += ids.numel()
        return forward(ids, meta, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "_embed", counted_forward)
    return counted


def spying(engine, monkeypatch) -> list:
    """The clusters each call of `PromptBatches.run_shared` gets."""
    ran = []
    shared = engine.runner.prompt_batches.run_shared
    monkeypatch.setattr(engine.runner.prompt_batches, "run_shared",
                        lambda groups, clusters, *head: ran.append(clusters) or shared(groups, clusters, *head))
    return ran


def same_columns(a, b) -> None:
    """Two prompts' columns bit for bit: every array (log probabilities, ranks, top-k ids and values, the
    whole vocabulary and its ranks, asked ids and statistics). A kept prefix gives a prompt the bits it has
    without the cache (docs/performance.md, 'The same bits beside other requests'), on a torch whose
    attention kernel allows it; on an older one (the lowest end of the range), within float tolerance."""
    if not Attention.invariant_kernels():
        return close_columns(a, b)
    for name in ("logprobs", "ranks", "top_ids", "top_logprobs", "full", "full_ranks"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None) and (x is None or np.array_equal(x, y, equal_nan=True)), name
    assert (a.extras is None) == (b.extras is None)
    if a.extras is not None:
        for name, x in vars(a.extras).items():
            if isinstance(x, np.ndarray):
                assert np.array_equal(x, getattr(b.extras, name), equal_nan=True), name


def close_columns(a, b, tol: float = TOL) -> None:
    """Every column of two prompts' columns within float tolerance (a rank or a top-k id as near-ties
    within it allow)."""
    for name in ("logprobs", "top_logprobs", "full"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None) and (x is None or np.allclose(x, y, atol=tol, equal_nan=True)), name
    assert np.abs(a.ranks - b.ranks).max() <= 1
    if a.full is not None:  # every token's rank: within the places its near-ties allow
        for row, ranks in zip(b.full[1:], a.full_ranks[1:]):
            ascending = np.sort(row)
            low = row.size - np.searchsorted(ascending, row + 2 * tol, side="right") + 1
            high = row.size - np.searchsorted(ascending, row - 2 * tol, side="right") + 1
            assert ((low <= ranks) & (ranks <= high)).all()
    ties = np.abs(np.diff(a.top_logprobs, axis=1)) < tol  # a tie may swap two ids
    swapped = a.top_ids != b.top_ids
    assert not (swapped & ~(np.pad(ties, ((0, 0), (0, 1))) | np.pad(ties, ((0, 0), (1, 0))))).any()
    if a.extras is None:
        assert b.extras is None
        return
    for name, x in vars(a.extras).items():
        y = getattr(b.extras, name)
        if not isinstance(x, np.ndarray) or name == "top_p_ids":
            continue
        if x.dtype.kind == "f":
            assert np.allclose(x, y, atol=tol, equal_nan=True), name
        elif x.dtype.kind != "b":  # ranks, set sizes: a near-tie moves them by one
            assert np.abs(x.astype(np.int64) - y).max() <= 1, name


def check_reference(reference, ids, cols) -> None:
    ref = reference.logprobs(ids).numpy()
    want = ref[np.arange(len(ids) - 1), ids[1:]]
    assert np.abs(cols.logprobs[1:] - want).max() < TOL
    for i in range(1, len(ids)):
        low, high = reference.rank_bounds(ref[i - 1], ids[i])
        assert low <= cols.ranks[i] <= high
    if cols.full is not None:
        assert np.abs(cols.full[1:] - ref[:-1]).max() < TOL
    if cols.extras is not None and cols.extras.token_id_logprobs is not None:
        assert np.abs(cols.extras.token_id_logprobs[1:] - ref[:-1][:, [5, 9, 100]]).max() < TOL


@pytest.fixture(scope="module")
def engines(tokenizer):
    """kind -> (model, engine with the cache, engine without), built once per family."""
    made = {}

    def of(kind):
        if kind not in made:
            model = build(kind, len(tokenizer))
            made[kind] = (model, Engine(model, tokenizer, f"{kind}-cached", []),
                          Engine(model, tokenizer, f"{kind}-uncached", [], prefix_cache_mb=0))
        return made[kind]

    return of


@pytest.mark.parametrize("kind", ["llama", "gemma3", "mistral"])
def test_answers_in_separate_batches_reuse_the_context(kind, tokenizer, engines, reference_of, monkeypatch):
    """The 4 answers of one question, each its own batch: the first runs whole and seeds the cache, the
    other 3 run only their own tokens (the context's whole blocks come from the cache) and every column
    equals the uncached engine's and the reference's. Gemma 3 and Mistral: the kept prefix (32 tokens) is
    longer than the sliding window (12), so their own tokens' windows begin inside the kept keys."""
    model, cached, uncached = engines(kind)
    reference = reference_of(model)
    prompts = prompts_of(tokenizer)
    ctx = len(tokenizer(CONTEXT).input_ids)
    kept = (ctx // BLOCK) * BLOCK
    assert kept > WINDOW and kept >= 32
    cache = cached.runner.prefix_cache
    counted = counting(cached, monkeypatch)
    for params in SETTINGS:
        cache.clear()
        hits = cache.hits
        for n, ids in enumerate(prompts):
            counted["tokens"] = 0
            a, = columns(cached, [ids], params)
            b, = columns(uncached, [ids], params)
            # the first runs whole; the others from the context's kept blocks on
            assert counted["tokens"] == (len(ids) if n == 0 else len(ids) - min(kept, (len(ids) - 1) // BLOCK * BLOCK))
            assert cache.hits - hits == n
            same_columns(a, b)
            check_reference(reference, ids, a)
        # one entry: the long answer's blocks replaced the first answer's (it extends them); the others
        # part from it inside the context's last block, and would hold the context a second time
        assert len(cache) == 1 and 0 < cache.nbytes <= cache.max_bytes
    # the long answer's own whole blocks were kept beyond the context's: the same prompt again runs less
    long = prompts[1]
    counted["tokens"] = 0
    a, = columns(cached, [long], SETTINGS[0])
    assert counted["tokens"] == len(long) - (len(long) - 1) // BLOCK * BLOCK < len(long) - kept
    same_columns(a, columns(uncached, [long], SETTINGS[0])[0])


def test_kept_and_batch_prefixes_together(tokenizer, engines, reference_of, monkeypatch):
    """One batch holding two prompts on the same kept prefix (which share no more than it in the batch:
    the kept one is used), a question's answers whose kept prefix is shorter than the context they share
    in the batch (the batch's is used), and a prompt with nothing in common: columns as without the
    cache, and as the reference's."""
    model, cached, uncached = engines("gemma3")
    reference = reference_of(model)
    cached.runner.prefix_cache.clear()
    long = prompts_of(tokenizer)[1]
    kept = len(long) // BLOCK * BLOCK
    second = prompts_of(tokenizer, "Passage: a baker in the harbour town rose at four every morning to light "
                                   "the ovens before the boats came in. Question: when did the baker rise? Answer:",
                        (" at four", " before the boats", " late"))
    other = tokenizer("Something else entirely, with nothing in common").input_ids
    columns(cached, [long], SETTINGS[2])  # kept: its whole blocks
    columns(cached, [second[0][:BLOCK + 2]], SETTINGS[2])  # kept: the second context's first block only
    ran = spying(cached, monkeypatch)
    batch = [long[:kept] + [11], second[0], other, long[:kept] + [12, 13], second[1], second[2]]
    for params in SETTINGS:
        together = columns(cached, batch, params)
        alone = columns(uncached, batch, params)
        for ids, a, b in zip(batch, together, alone):
            same_columns(a, b)
            check_reference(reference, ids, a)
    clusters = ran[0]
    assert [sorted(c[1]) for c in clusters if len(c) == 2] == [[1, 4, 5]]  # longer than their kept block
    assert [(c[0], sorted(c[1])) for c in clusters if len(c) == 3] == [(kept, [0, 3])]


def test_eviction_keeps_the_bound_and_the_answers(tokenizer, engines, reference_of):
    """A bound that holds one question's entry: each question's second answer hits its first's, a
    question's entry is gone once another's came in, the bytes held never exceed the bound, and the
    answers stay right."""
    model, cached, uncached = engines("llama")
    reference = reference_of(model)
    runner = cached.runner
    per_token = len(runner.layers) * 2 * runner.kv_heads * runner.head_dim * 4 + model.config.hidden_size * 4
    questions = [prompts_of(tokenizer, f"Question {q}: " + CONTEXT, ANSWERS[::2]) for q in range(3)]
    largest = max(len(ids) // BLOCK * BLOCK for prompts in questions for ids in prompts)
    saved = cached.use_prefix_cache(cache := PrefixCache(int(largest * per_token * 1.5)))  # one entry, not two
    try:
        order = [(q, n) for q in range(3) for n in range(2)] + [(0, 0)]  # the last: evicted since
        hits = []
        for q, n in order:
            ids = questions[q][n]
            before = cache.hits
            a, = columns(cached, [ids], SETTINGS[0])
            hits.append(cache.hits - before)
            same_columns(a, columns(uncached, [ids], SETTINGS[0])[0])
            check_reference(reference, ids, a)
            assert 0 < cache.nbytes <= cache.max_bytes and len(cache) == 1
        assert hits == [0, 1, 0, 1, 0, 1, 0]
    finally:
        cached.use_prefix_cache(saved)


def test_hash_collisions_in_the_engine(tokenizer, engines, reference_of, monkeypatch):
    """Every block hashes alike: a prompt that shares only the first block of a kept prefix uses that
    block, one that shares nothing uses nothing, and the columns stay right."""
    monkeypatch.setattr(prefix_index, "block_hash", lambda previous, block: 0)
    model, cached, uncached = engines("llama")
    reference = reference_of(model)
    cached.runner.prefix_cache.clear()
    counted = counting(cached, monkeypatch)
    prompts = prompts_of(tokenizer)
    ctx = tokenizer(CONTEXT).input_ids
    near = ctx[:BLOCK + 3] + [t + 1 for t in ctx[BLOCK + 3:]]  # the first block in common
    far = [t + 7 for t in ctx]
    columns(cached, [prompts[0]], SETTINGS[0])
    for ids, skipped in ((near, BLOCK), (far, 0)):
        counted["tokens"] = 0
        a, = columns(cached, [ids], SETTINGS[1])
        assert counted["tokens"] == len(ids) - skipped
        same_columns(a, columns(uncached, [ids], SETTINGS[1])[0])
        check_reference(reference, ids, a)


def test_interventions_neither_use_nor_seed_the_cache(tokenizer, engines, monkeypatch):
    """A group with interventions runs a modified pass: it takes no kept prefix, shares none in its
    batch, and leaves nothing in the cache (the gate reads only whether it has any)."""
    _, cached, _ = engines("llama")
    cache = cached.runner.prefix_cache
    cache.clear()
    counted = counting(cached, monkeypatch)
    prompts = prompts_of(tokenizer)
    looked = cache.hits + cache.misses
    columns(cached, [prompts[0]], SETTINGS[0], interventions=(object(),))
    assert (len(cache), cache.nbytes, cache.hits + cache.misses) == (0, 0, looked)
    columns(cached, [prompts[0]], SETTINGS[0])  # seeds it
    entries, nbytes, hits = len(cache), cache.nbytes, cache.hits
    assert entries == 1
    counted["tokens"] = 0
    columns(cached, [prompts[2]], SETTINGS[0], interventions=(object(),))
    assert counted["tokens"] == len(prompts[2]) and cache.hits == hits
    ran = spying(cached, monkeypatch)
    groups = [SequenceGroup(f"s{i}", ids, SamplingParams(**SETTINGS[0], interventions=interventions), cached.table)
              for i, (ids, interventions) in enumerate([(prompts[1], (object(),)), (prompts[2], ()),
                                                        (prompts[3], ())])]
    with torch.inference_mode():
        cached.runner.prefill_batch(groups)
    assert {m for c in ran[-1] for m in c[1]} == {1, 2}  # in no cluster, from the batch or the cache
    assert cache.hits == hits + 2
    # the long answer's whole blocks past the context were not kept
    assert (len(cache), cache.nbytes) == (entries, nbytes)


def test_a_zero_bound_turns_the_cache_off(tokenizer, engines, monkeypatch):
    _, _, uncached = engines("llama")
    cache = uncached.runner.prefix_cache
    counted = counting(uncached, monkeypatch)
    for ids in prompts_of(tokenizer):
        counted["tokens"] = 0
        columns(uncached, [ids], SETTINGS[0])
        assert counted["tokens"] == len(ids)
    assert (len(cache), cache.nbytes, cache.hits, cache.misses) == (0, 0, 0, 0)


def test_reset_empties_it(tokenizer, engines):
    _, cached, _ = engines("llama")
    columns(cached, prompts_of(tokenizer)[:1], SETTINGS[0])
    assert cached.runner.prefix_cache.nbytes > 0
    assert cached.stats()["prefix_cache_bytes"] == cached.runner.prefix_cache.nbytes  # /metrics reads this
    cached.runner.reset()
    assert cached.runner.prefix_cache.nbytes == 0 and len(cached.runner.prefix_cache) == 0


def test_the_scheduler_charges_only_the_tokens_to_compute(engines, monkeypatch):
    """A 208-token prompt whose first 192 or more tokens the cache holds, admitted beside a decoding row
    with chunks of 40 tokens: the scheduler counts the held tokens computed as it admits the prompt (the
    runner's `start_prompt`), so its first chunk is the rest (16 tokens at most), a prompt admitted after
    it gets the rest of the step's 40, and both answers have the bits they have on the engine without the
    cache (their first tokens' log probabilities, their prompt's)."""
    rng = np.random.default_rng(23)
    seed = [1] + [int(t) for t in rng.integers(3, 40_000, 199)]
    other = [1] + [int(t) for t in rng.integers(3, 40_000, 99)]
    _, cached, uncached = engines("llama")

    def run(engine):
        scheduler, plans = engine.scheduler, []
        monkeypatch.setattr(scheduler, "prefill_chunk_tokens", 40)
        cache = engine.runner.prefix_cache
        cache.clear()
        seeder = SequenceGroup("seed", seed, SamplingParams(max_tokens=0, echo=True, prompt_logprobs=1), engine.table)
        decoding = SequenceGroup("decoding", other[:20], SamplingParams(max_tokens=12, temperature=0), engine.table)
        held = SequenceGroup("held", seed + [5] * 8, SamplingParams(max_tokens=2, prompt_logprobs=1, temperature=0),
                             engine.table)
        late = SequenceGroup("late", other, SamplingParams(max_tokens=2, prompt_logprobs=1, temperature=0), engine.table)
        for group in (seeder, decoding):
            scheduler.add(group)
        with torch.inference_mode():
            while not decoding.sequences[0].token_ids:  # the seeded prompt kept, the row decoding
                engine.step(scheduler.schedule())
            scheduler.add(held)
            scheduler.add(late)
            while scheduler.has_work:
                plan = scheduler.schedule()
                plans.append([(c.group.request_id, c.num_tokens) for c in plan.prefill])
                engine.step(plan)
        assert all(g.error is None for g in (seeder, decoding, held, late))
        return plans, held.num_cached_tokens, [(g.sequences[0].token_ids, g.sequences[0].logprobs,
                                                g.prompt_columns.logprobs) for g in (held, late)]

    plans, hit, answers = run(cached)
    assert 192 <= hit < 200 and len(seed) + 8 - hit <= 16
    assert plans[0] == [("held", len(seed) + 8 - hit), ("late", 40 - (len(seed) + 8 - hit))], plans
    plans, hit, alone = run(uncached)
    assert hit == 0
    assert plans[0] == [("held", 40)], plans
    for (tokens, logprobs, prompt), (tokens0, logprobs0, prompt0) in zip(answers, alone):
        assert tokens == tokens0 and np.array_equal(logprobs, logprobs0)
        assert np.array_equal(prompt, prompt0, equal_nan=True)
