"""The batched KV cache in size classes (the engine's manager, engine/host/kv_manager.py, and the lean
runner's memory, engine/runners/kv_cache.py): its memory follows the positions held, and rows moving into
larger classes, or leaving theirs, change no number.

Engines here run step by step on the test's own thread (`drive`: the engine's `step`, as its loop calls
it), so a batch is scheduled the same way on every run, and the manager's bookkeeping, and the memory
against it, are checked after every step. Tiny random-weight float32 models with a tiny first class (4 or 16 positions), so rows cross
several class boundaries while others decode; tolerance 1e-5 on log probabilities, as in the other
engine tests, against the same requests run alone and against the float64 reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from logprobe.engine.engine import Engine
from logprobe.engine.host.request import SamplingParams, SequenceGroup

TOL = 1e-5


@pytest.fixture(scope="module")
def llama(tiny_model_factory, tokenizer, reference_of):
    model = tiny_model_factory(len(tokenizer), seed=7, max_position_embeddings=512)
    return model, reference_of(model)


@pytest.fixture(scope="module")
def gemma3(tokenizer, reference_of):
    """Gemma 3: a sliding layer (window 12) and a full one, each with its own RoPE table."""
    import transformers as tf

    cfg = tf.Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=12,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
        final_logit_softcapping=3.0, tie_word_embeddings=True, max_position_embeddings=256,
        initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(8)
    model = tf.Gemma3ForCausalLM(cfg).eval()
    model.requires_grad_(False)
    return model, reference_of(model)


@pytest.fixture(scope="module")
def engine4(llama, tokenizer):
    engine = Engine(llama[0], tokenizer, "test/kv4", kv_cache_positions=4)
    assert engine.info.runner == "lean"
    return engine


def prompt(length: int, start: int = 0) -> list[int]:
    gen = np.random.default_rng(1000 * start + length)
    return [1] + [int(t) for t in gen.integers(3, 40_000, length - 1)]


def make(engine, ids, **params) -> SequenceGroup:
    return SequenceGroup("t", list(ids), SamplingParams(**params), engine.table)


def drive(engine, groups, observe=None):
    """Run `groups` to their end, one engine step at a time; after each step the runner's bookkeeping
    must be whole (as the engine's loop checks), and `observe()` runs."""
    scheduler = engine.scheduler
    for group in groups:
        scheduler.add(group)
    while scheduler.has_work:
        engine.step(scheduler.schedule())
        assert engine.kv.is_consistent(scheduler.running) and engine.runner.is_consistent(scheduler.running)
        if observe is not None:
            observe()
    assert all(g.error is None and g.is_finished for g in groups)
    assert not engine.kv.rows and not engine.kv.held
    return groups


def bytes_per_position(model) -> int:
    """Keys and values of one position in every layer, from the model's configuration."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * torch.finfo(model.dtype).bits // 8


def classes(engine) -> list[tuple[int, int, int]]:
    """(capacity, slots, rows) of each size class, the manager's; the runner's memory holds exactly these."""
    memory = engine.runner.cache
    assert memory.matches(engine.kv)
    assert [(c, s.num_slots) for c, s in memory.slabs.items()] == [(c, k.num_slots) for c, k in engine.kv.classes.items()]
    return [(capacity, c.num_slots, len(c.rows)) for capacity, c in engine.kv.classes.items()]


def answers(groups):
    """Per group, per choice: (tokens, log probabilities, top log probabilities)."""
    return [[(list(s.token_ids), np.asarray(s.logprobs), np.stack(s.top_logprobs) if s.top_logprobs else None)
             for s in g.sequences] for g in groups]


def assert_same(got, want, exact=False):
    for g_got, g_want in zip(got, want, strict=True):
        for (tokens, lps, top), (want_tokens, want_lps, want_top) in zip(g_got, g_want, strict=True):
            assert tokens == want_tokens
            if exact:
                np.testing.assert_array_equal(lps, want_lps)
            else:
                np.testing.assert_allclose(lps, want_lps, atol=TOL, rtol=0)
            if want_top is not None:
                np.testing.assert_allclose(top, want_top, atol=0 if exact else TOL, rtol=0)


def check_reference(reference, group):
    """Every choice's log probabilities are the float64 reference's on prompt + generated tokens, and a
    greedy choice took the likeliest token (up to float32 near-ties)."""
    p = len(group.prompt_ids)
    for s in group.sequences:
        ref = reference.logprobs(group.prompt_ids + s.token_ids).numpy()
        want = [ref[p - 1 + i][t] for i, t in enumerate(s.token_ids)]
        np.testing.assert_allclose(s.logprobs, want, atol=TOL, rtol=0)
        if group.params.is_greedy:
            for i, t in enumerate(s.token_ids):
                assert ref[p - 1 + i][t] >= ref[p - 1 + i].max() - 2 * TOL


class Moves:
    """After each step: which rows changed size class while other rows kept decoding, which rows left
    (and from which class), and the most classes holding rows at once."""

    def __init__(self, kv):
        self.kv = kv
        self.where: dict[int, tuple[object, int]] = {}  # id(row) -> (row, class)
        self.moved_beside_others = 0
        self.left_from: list[int] = []
        self.most_classes = 0

    def __call__(self):
        kv = self.kv
        now = {id(r): (r, r.slab) for r in kv.rows}
        moved = [i for i in now if i in self.where and now[i][1] != self.where[i][1]]
        if moved and len(now) > len(moved):
            self.moved_beside_others += 1
        self.left_from += [slab for i, (_, slab) in self.where.items() if i not in now]
        self.most_classes = max(self.most_classes, sum(1 for c in kv.classes.values() if c.rows))
        self.where = now


def batch(engine):
    """Requests of different prompt lengths, greedy and seeded sampling, n = 2, logprobs: with a first
    class of 4 positions every row crosses classes (4, 8, 16, 32, 64) at its own steps."""
    return [make(engine, prompt(3, 1), max_tokens=40, temperature=0, logprobs=3),
            make(engine, prompt(5, 2), max_tokens=30, temperature=0.8, seed=11, n=2, logprobs=2),
            make(engine, prompt(10, 3), max_tokens=25, temperature=0, logprobs=1),
            make(engine, prompt(17, 4), max_tokens=20, temperature=1.0, seed=12, logprobs=1),
            make(engine, prompt(30, 5), max_tokens=12, temperature=0, logprobs=2),
            make(engine, prompt(2, 6), max_tokens=35, temperature=0.7, seed=13)]


# ---- memory -----------------------------------------------------------------------------------------
def test_memory_follows_the_positions_held(llama, tokenizer):
    """A 250-token prompt decoding beside 31 short ones (first class: 16 positions): the cache holds each
    row in a class at most twice its length, its bytes are exactly what its slabs allocate, and they stay
    far below what a slot per row as long as the longest row would take."""
    model = llama[0]
    engine = Engine(model, tokenizer, "test/kv16", kv_cache_positions=16)
    cache = engine.runner.cache
    per_position = bytes_per_position(model)
    assert per_position == 2 * cache.num_layers * cache.kv_heads * cache.head_dim * 4
    assert classes(engine) == [(16, 4, 0)] and cache.nbytes == 4 * cache.positions(16) * per_position  # (Attention.held)
    long = make(engine, prompt(250, 7), max_tokens=12, temperature=0, logprobs=1)  # 256, then 512
    shorts = [make(engine, prompt(3 + i % 5, 8 + i), max_tokens=14, temperature=0) for i in range(31)]  # 16, 32
    steps = []
    moves = Moves(engine.kv)

    def observe():
        lengths = [(r.slab, r.length) for r in engine.kv.rows]
        spare = sum((c.num_slots - len(c.rows)) * cache.positions(capacity) for capacity, c in engine.kv.classes.items())
        steps.append((cache.nbytes, engine.stats()["kv_cache_bytes"], lengths, spare, classes(engine)))
        moves()

    drive(engine, [long, *shorts], observe)
    peak = 0
    for nbytes, reported, lengths, spare, held_classes in steps:
        assert reported == nbytes  # what the engine reports
        assert all(rows for capacity, _, rows in held_classes if capacity != 16)  # an emptied class is let go
        # (a class holds the positions a read cut at its end needs: its capacity, or 512 for the 256 class
        # where the CPU's attention kernel splits a last block of 256 keys: Attention.held)
        assert nbytes == per_position * sum(cache.positions(capacity) * slots for capacity, slots, _ in held_classes)
        if not lengths:
            continue
        # each row's class is at most twice its length (or the first class)
        assert all(capacity <= max(16, 2 * length) for capacity, length in lengths)
        held = sum(max(length, 8) for _, length in lengths)
        aligned = sum(cache.positions(capacity) - capacity for capacity, _ in lengths)  # Attention.held's extra
        assert nbytes <= per_position * (2 * held + spare + aligned)
        longest = max(length for _, length in lengths)
        if len(lengths) == 32:  # everyone decoding
            peak = max(peak, nbytes)
            assert nbytes <= per_position * 32 * longest / 2.5  # (the short rows hold 64 positions: Attention.held)
            assert spare <= 32 * 16 + held  # the first class's slots, and doubling
    assert peak and moves.most_classes == 3 and moves.moved_beside_others >= 2  # 16, 32 and 512 at once
    assert len(long.sequences[0].token_ids) == 12 and all(len(s.sequences[0].token_ids) == 14 for s in shorts)
    engine.on_idle()
    assert classes(engine) == [(16, 4, 0)] and cache.nbytes == 4 * cache.positions(16) * per_position
    assert engine.stats()["kv_cache_bytes"] == 4 * cache.positions(16) * per_position


def test_the_first_class_goes_back_to_its_initial_slots(engine4, llama):
    """Eight rows fill the first class (4 positions: 8 slots), then all move on: its slots go back to 4
    while they decode, and each emptied class is let go."""
    engine = engine4
    engine.on_idle()
    seen = []
    groups = [make(engine, prompt(2, 40 + i), max_tokens=12, temperature=0) for i in range(8)]
    drive(engine, groups, lambda: seen.append(classes(engine)))
    assert seen[0] == [(4, 8, 8)]  # every prompt in the first class
    assert [(4, 4, 0), (16, 8, 8)] in seen  # all moved on (through 8 to 16): 4 slots again
    check_reference(llama[1], groups[0])


# ---- numbers ----------------------------------------------------------------------------------------
def test_rows_crossing_classes_give_the_numbers_they_give_alone(engine4, llama):
    """The same requests alone (one class at a time) and together (rows in several classes, moving at
    different steps): the same tokens and log probabilities; the sequences that cross the most classes
    against the float64 reference."""
    engine = engine4
    alone = [drive(engine, [g])[0] for g in batch(engine)]
    for g in alone:
        assert all(len(s.token_ids) == g.params.max_tokens for s in g.sequences)
    moves = Moves(engine.kv)
    together = drive(engine, batch(engine), moves)
    assert moves.moved_beside_others >= 5 and moves.most_classes >= 3
    assert_same(answers(together), answers(alone))
    reference = llama[1]
    for g in together[:2]:  # 3 + 40 positions: classes 4 to 64; sampled, n = 2: 5 + 30
        check_reference(reference, g)


def test_sliding_windows_in_several_classes(gemma3, tokenizer):
    """Gemma 3's sliding (12) and full layers while rows in different classes are inside and past the
    window: every choice against the float64 reference."""
    model, reference = gemma3
    engine = Engine(model, tokenizer, "test/kv-gemma3", kv_cache_positions=4)
    assert engine.info.runner == "lean" and engine.runner.windows == [12, None]
    groups = [make(engine, prompt(3, 21), max_tokens=30, temperature=0),
              make(engine, prompt(9, 22), max_tokens=20, temperature=0.9, seed=3, n=2),
              make(engine, prompt(14, 23), max_tokens=14, temperature=0, logprobs=1),
              make(engine, prompt(27, 24), max_tokens=8, temperature=0)]
    moves = Moves(engine.kv)
    drive(engine, groups, moves)
    assert moves.moved_beside_others >= 3 and moves.most_classes >= 3
    for g in groups:
        check_reference(reference, g)


# ---- sequences of batches ---------------------------------------------------------------------------
def test_back_to_the_first_size_and_the_same_answers_again(engine4, llama):
    """A batch that grows the cache, idle, the same batch again, then one request alone: the cache is
    back to its first size after each batch, and the answers are the same bit for bit."""
    engine = engine4
    cache = engine.runner.cache
    per_position = bytes_per_position(llama[0])
    engine.on_idle()
    initial = 4 * cache.positions(4) * per_position  # 4 slots of the first class (its positions: Attention.held)
    assert classes(engine) == [(4, 4, 0)] and cache.nbytes == initial
    single = answers(drive(engine, batch(engine)[:1]))
    rounds = []
    for _ in range(2):
        largest = []
        rounds.append(answers(drive(engine, batch(engine), lambda: largest.append(cache.nbytes))))
        assert max(largest) > 4 * initial  # it grew
        engine.on_idle()
        assert classes(engine) == [(4, 4, 0)] and cache.nbytes == initial
        assert engine.stats()["kv_cache_bytes"] == initial
    assert_same(rounds[1], rounds[0], exact=True)
    assert_same(answers(drive(engine, batch(engine)[:1])), single, exact=True)


# ---- rows leaving mid-batch -------------------------------------------------------------------------
def test_rows_leaving_from_different_classes(engine4, llama):
    """Rows end at different steps (max_tokens, a stop token, choices of an n = 3 request ending before
    their siblings) from different classes: the others' numbers are those they have alone."""
    engine = engine4
    free = [make(engine, prompt(3, 31), max_tokens=36, temperature=1.0, seed=21, n=3, logprobs=2),
            make(engine, prompt(6, 32), max_tokens=30, temperature=0, logprobs=1),
            make(engine, prompt(12, 33), max_tokens=30, temperature=0.9, seed=22, logprobs=1),
            make(engine, prompt(21, 34), max_tokens=30, temperature=0)]
    alone = [drive(engine, [g])[0] for g in free]
    # stop tokens: the 5th token of the n = 3 request's first choice, the 13th of the third request
    stop_a = alone[0].sequences[0].token_ids[4]
    stop_c = alone[2].sequences[0].token_ids[12]
    together = [make(engine, prompt(3, 31), max_tokens=36, temperature=1.0, seed=21, n=3, logprobs=2,
                     stop_token_ids=frozenset({stop_a})),
                make(engine, prompt(6, 32), max_tokens=9, temperature=0, logprobs=1),
                make(engine, prompt(12, 33), max_tokens=30, temperature=0.9, seed=22, logprobs=1,
                     stop_token_ids=frozenset({stop_c})),
                make(engine, prompt(21, 34), max_tokens=30, temperature=0)]
    selects = []
    real_select = engine.kv.select

    def select(group, keep):
        selects.append((len(engine.kv.rows_of(group)), len(keep)))
        return real_select(group, keep)

    moves = Moves(engine.kv)
    engine.kv.select = select
    try:
        drive(engine, together, moves)
    finally:
        del engine.kv.select
    assert selects and all(0 < kept < rows for rows, kept in selects)  # choices ended before their siblings
    assert len(set(moves.left_from)) >= 3  # rows left from three classes or more

    def cut(seq, stops, max_tokens):
        ends = [i + 1 for i, t in enumerate(seq.token_ids) if t in stops]
        return min([max_tokens, *ends])

    want = []
    for g_alone, g in zip(alone, together):
        want.append([])
        for s in g_alone.sequences:
            n = cut(s, g.params.stop_token_ids, g.params.max_tokens)
            top = np.stack(s.top_logprobs[:n]) if s.top_logprobs else None
            want[-1].append((s.token_ids[:n], np.asarray(s.logprobs[:n]), top))
    assert [len(s.token_ids) for s in together[0].sequences] != [36] * 3  # the stop token ended some
    assert len(together[2].sequences[0].token_ids) <= 13 and len(together[1].sequences[0].token_ids) == 9
    assert_same(answers(together), want)
    check_reference(llama[1], together[3])
