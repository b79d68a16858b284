"""The fixed-shape decode step (lean.fixed_shape.FixedShapeSteps.run): what a GPU records once as a CUDA
graph and replays, run here eagerly on the CPU. It pads the batch to a power of two (padding rows
write into unused slots) and attends over the slab's whole capacity with a length mask (and each
sliding window's band) instead of the positions held so far. Its answers must be the eager path's,
and the float64 reference's, while rows join, leave, and move between size classes (where the step
falls back to the eager path for the steps the batch spans two classes).

Slow: torch.compile compiles the fixed-shape step on the CPU."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest
import torch

from logprobe.engine.runners.kv_cache import Slab
from logprobe.engine.runners.lean import fixed_shape
from logprobe.engine.engine import Engine
from logprobe.engine.host.request import SamplingParams, SequenceGroup
from test_families import build

TOL = 1e-5


def groups_of(engine):
    prompts = ["a b", "The quick brown fox jumps", "One two three four five six seven eight nine ten eleven"]
    kinds = [dict(temperature=0.0, logprobs=3), dict(temperature=1.0, n=2, seed=4, logprobs=2),
             dict(temperature=0.8, top_p=0.9, seed=9), dict(temperature=1.0, top_k=5, seed=1, logprobs=1)]
    out = []
    for i, kind in enumerate(kinds * 2):
        ids = engine.tokenizer(prompts[i % len(prompts)]).input_ids
        out.append(SequenceGroup(f"g{i}", ids, SamplingParams(max_tokens=6 + 7 * (i % 4), **kind), engine.table))
    return out


def run(engine, groups):
    asyncio.run(engine.run_groups(groups))
    return groups


def same_and_exact(sa, sb, gb, reference):
    """Sequence `sb` (of group `gb`) has `sa`'s log probabilities and top-k within TOL, and its log
    probabilities are the float64 forward's within TOL."""
    assert np.allclose(sa.logprobs, sb.logprobs, atol=TOL)
    for ta, tb in zip(sa.top_logprobs, sb.top_logprobs):
        assert np.allclose(ta, tb, atol=TOL)
    ref = reference.logprobs(list(gb.prompt_ids) + sb.token_ids).numpy()
    start = len(gb.prompt_ids) - 1
    want = ref[np.arange(start, start + len(sb.token_ids)), sb.token_ids]
    assert np.abs(np.asarray(sb.logprobs) - want).max() < TOL


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_the_fixed_shape_step_answers_as_the_eager_one(kind, tokenizer, reference_of, monkeypatch):
    model = build(kind, len(tokenizer))
    eager = Engine(model, tokenizer, "eager", [], kv_cache_positions=8)
    static = Engine(model, tokenizer, "static", [], kv_cache_positions=8)
    assert not eager.runner.static_decode  # the CPU's default
    static.runner.static_decode = True
    passes = []
    original = static.runner.fixed_shape.decode_pass
    static.runner.fixed_shape.decode_pass = lambda k, v, ids, *rest: passes.append(ids.shape[0]) or original(k, v, ids, *rest)
    made = []

    class Counted(fixed_shape.StaticStep):
        def __init__(self, *args):
            made.append(1)
            super().__init__(*args)

    monkeypatch.setattr(fixed_shape, "StaticStep", Counted)
    eager_steps = []
    original_eager = static.runner._decode_eager
    static.runner._decode_eager = lambda *args: eager_steps.append(1) or original_eager(*args)
    reference = reference_of(model)
    for engine in (eager, static):
        engine.start()
    try:
        for round_ in range(2):  # a second round on the same engines: nothing left over from the first
            a, b = run(eager, groups_of(eager)), run(static, groups_of(static))
            for ga, gb in zip(a, b):
                for sa, sb in zip(ga.sequences, gb.sequences):
                    assert sa.token_ids == sb.token_ids, (kind, ga.request_id)
                    same_and_exact(sa, sb, gb, reference)
    finally:
        for engine in (eager, static):
            engine.stop()
    # the fixed-shape step ran, on padded batches (sizes that are powers of two), as well as the eager
    # path (for the steps spanning two size classes)
    assert passes and set(passes) <= {1, 2, 4, 8, 16} and eager_steps
    # Steps are kept across decode steps and rounds (as a GPU keeps its graphs), each dropped once its
    # slab holds other tensors: a kept step runs over the tensors it was made on, so one kept past a
    # change of its slab would have given wrong numbers above. Fewer steps were made than passes ran.
    assert len(made) < len(passes)
    assert all(step.holds(static.runner.cache) for step in static.runner.fixed_shape.graphs.values())
    static.on_idle()
    assert not static.runner.fixed_shape.graphs
    assert static.runner.cache.matches(static.kv) and static.kv.is_consistent()


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_the_fixed_shape_step_picks_the_tokens_the_engine_would(kind, tokenizer, reference_of):
    """Where no row filters with top-k or top-p, the fixed-shape step (a GPU's graph) also draws each
    row's token and gathers its log probability and the top-k, from settings moved with its inputs:
    the same tokens, log probabilities and top-k as the engine's own pick after the eager pass, greedy
    and seeded rows mixed, batches padded, then an all-greedy batch (its own kind of step)."""
    model = build(kind, len(tokenizer))
    eager = Engine(model, tokenizer, "eager", [], kv_cache_positions=8)
    static = Engine(model, tokenizer, "static", [], kv_cache_positions=8)
    static.runner.static_decode = True
    kinds = [dict(temperature=0.0, logprobs=3), dict(temperature=1.0, n=2, seed=4, logprobs=2),
             dict(temperature=0.7, seed=9), dict(temperature=0.0), dict(temperature=1.3, seed=5, logprobs=5)]
    prompts = ["a b", "The quick brown fox jumps", "One two three four five six"]
    picked, pickings = [], []
    original_pick, original_pass = static.runner.decode_and_pick, static.runner.fixed_shape.decode_pass
    static.runner.decode_and_pick = lambda groups, k: (lambda out: picked.append(out[1] is not None) or out)(
        original_pick(groups, k))
    static.runner.fixed_shape.decode_pass = lambda *args: pickings.append(args[5]) or original_pass(*args)  # (k, sampled)

    def groups_for(engine, settings):
        return [SequenceGroup(f"g{i}", engine.tokenizer(prompts[i % 3]).input_ids,
                              SamplingParams(max_tokens=5 + 4 * (i % 3), **kind), engine.table)
                for i, kind in enumerate(settings)]

    reference = reference_of(model)
    drawn = 0  # generated tokens of seeded rows that are not the likeliest (the draw is exercised)
    for engine in (eager, static):
        engine.start()
    try:
        for settings in (kinds * 2, [dict(temperature=0.0, logprobs=4)] * 3):
            a, b = run(eager, groups_for(eager, settings)), run(static, groups_for(static, settings))
            for ga, gb in zip(a, b):
                for sa, sb in zip(ga.sequences, gb.sequences):
                    assert sa.token_ids == sb.token_ids, (kind, ga.request_id)
                    assert np.allclose(sa.logprobs, sb.logprobs, atol=TOL)
                    assert [t.tolist() for t in sa.top_ids] == [t.tolist() for t in sb.top_ids]
                    for ta, tb in zip(sa.top_logprobs, sb.top_logprobs):
                        assert np.allclose(ta, tb, atol=TOL)
                    ids = list(gb.prompt_ids) + sb.token_ids
                    ref = reference.logprobs(ids).numpy()
                    start = len(gb.prompt_ids) - 1
                    positions = np.arange(start, start + len(sb.token_ids))
                    want = ref[positions, sb.token_ids]
                    assert np.abs(np.asarray(sb.logprobs) - want).max() < TOL
                    if gb.params.temperature > 0:
                        drawn += int((ref[positions].argmax(-1) != np.asarray(sb.token_ids)).sum())
    finally:
        for engine in (eager, static):
            engine.stop()
    assert drawn > 5
    # most decode steps were picked by the fixed-shape step (the others span two size classes: eager);
    # both kinds of step ran: with rows drawn and k = 5, and all greedy with k = 4
    assert sum(picked) > len(picked) // 2
    assert (5, True) in pickings and (4, False) in pickings


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_the_step_attends_over_the_span_its_rows_need(kind, tokenizer, reference_of, monkeypatch):
    """The fixed-shape step reads the least quarter of its slab's capacity that holds its longest row:
    a group of three rows growing through the classes of 32 and 64 positions runs steps over 24, 32,
    48 and 64 positions, each kept while its rows fit and a new one made when they cross, with the
    eager path's tokens and log probabilities and the float64 reference's (Gemma 3: a 12-token
    window inside the spans)."""
    model = build(kind, len(tokenizer))
    eager = Engine(model, tokenizer, "eager", [], kv_cache_positions=16)
    static = Engine(model, tokenizer, "static", [], kv_cache_positions=16)
    static.runner.static_decode = True
    made = []

    class Recorded(fixed_shape.StaticStep):
        def __init__(self, steps, slab, batch, picking=None, span=None):
            made.append((slab.capacity, span))
            super().__init__(steps, slab, batch, picking, span)

    monkeypatch.setattr(fixed_shape, "StaticStep", Recorded)
    prompt = list(range(20, 37))  # 17 tokens: the class of 32 positions, 18 held after the first step
    params = dict(max_tokens=44, temperature=0.8, seed=3, n=3, logprobs=2)
    for engine in (eager, static):
        engine.start()
    try:
        a = run(eager, [SequenceGroup("a", prompt, SamplingParams(**params), eager.table)])[0]
        b = run(static, [SequenceGroup("b", prompt, SamplingParams(**params), static.table)])[0]
    finally:
        for engine in (eager, static):
            engine.stop()
    reference = reference_of(model)
    for sa, sb in zip(a.sequences, b.sequences):
        assert sa.token_ids == sb.token_ids and len(sb.token_ids) == 44
        assert np.allclose(sa.logprobs, sb.logprobs, atol=TOL)
        ref = reference.logprobs(prompt + sb.token_ids).numpy()
        positions = np.arange(len(prompt) - 1, len(prompt) - 1 + len(sb.token_ids))
        assert np.abs(np.asarray(sb.logprobs) - ref[positions, sb.token_ids]).max() < TOL
    # one step per (class, span): 24 then 32 positions of the class of 32, 48 then 64 of the class of 64
    assert sorted(set(made)) == [(32, 24), (32, 32), (64, 48), (64, 64)] and len(made) == 4, made


def test_a_kept_step_is_dropped_when_its_slab_changes(tokenizer, reference_of):
    """A kept step (a GPU's recorded graph) writes and reads the tensors it was made on. When the slab's
    tensors are replaced (its slots grow, a class is rebuilt), the step must be dropped: a kept one
    would write the next key into the old tensors, and the steps after it (here eager ones) would
    attend to a position never written."""
    model = build("llama", len(tokenizer))
    engine = Engine(model, tokenizer, "static", [])
    runner = engine.runner
    runner.static_decode = True
    groups = [SequenceGroup(f"g{i}", engine.tokenizer(p).input_ids, SamplingParams(max_tokens=40, temperature=0.0),
                            engine.table) for i, p in enumerate(["a b c", "The quick brown fox", "One two three"])]
    for g in groups:
        engine.scheduler.add(g)
    with torch.inference_mode():
        for step in range(12):
            if step == 5:  # the slab's tensors replaced by copies (same contents, new storage)
                slab = next(iter(runner.cache.slabs.values()))
                runner.cache.slabs = {**runner.cache.slabs, slab.capacity: Slab(
                    slab.capacity, [t.clone() for t in slab.keys], [t.clone() for t in slab.values])}
            runner.static_decode = step < 8  # then eager steps, over the slab's current tensors
            engine.step(engine.scheduler.schedule())
    reference = reference_of(model)
    for g in groups:
        seq = g.sequences[0]
        assert len(seq.token_ids) >= 10
        ref = reference.logprobs(list(g.prompt_ids) + seq.token_ids).numpy()
        start = len(g.prompt_ids) - 1
        want = ref[np.arange(start, start + len(seq.token_ids)), seq.token_ids]
        assert np.abs(np.asarray(seq.logprobs) - want).max() < TOL


def test_random_mixes_over_rounds_answer_as_the_eager_engine(tokenizer):
    """Rounds of random mixes on one pair of engines (a seeded draw of settings: greedy or seeded,
    temperature, top-k or top-p now and then, n 1-3, logprobs 0-5, lengths 1-30 past several size
    classes): rows finish at different steps, so slots are compacted and a group's rows leave their
    order in the batch; batches with and without filters alternate between the pick in the step and
    the engine's. Every token, log probability and top-k equals the eager engine's."""
    model = build("llama", len(tokenizer))
    eager = Engine(model, tokenizer, "eager", [], kv_cache_positions=8)
    static = Engine(model, tokenizer, "static", [], kv_cache_positions=8)
    static.runner.static_decode = True
    picked, scattered = [], []
    original = static.runner.decode_and_pick
    static.runner.decode_and_pick = lambda groups, k: (lambda out: picked.append(out[1] is not None) or out)(
        original(groups, k))
    by_group = static.runner._by_group

    def spy(orders, logprobs):  # whether a group's rows sit out of their order in the batch
        scattered.append(any(order != list(range(order[0], order[0] + len(order))) for order in orders if order))
        return by_group(orders, logprobs)

    static.runner._by_group = spy

    def mix(engine, round_):
        draw = np.random.default_rng(100 + round_)
        groups = []
        for i in range(int(draw.integers(4, 9))):
            kind = dict(max_tokens=int(draw.integers(1, 31)), n=int(draw.integers(1, 4)),
                        logprobs=int(draw.integers(0, 6)))
            if draw.random() < 0.7:
                kind.update(temperature=float(draw.uniform(0.5, 1.5)), seed=int(draw.integers(0, 1000)))
                if draw.random() < 0.2:
                    kind.update(top_k=int(draw.integers(2, 20)) if draw.random() < 0.5 else 0,
                                top_p=float(draw.uniform(0.5, 0.95)))
            else:
                kind.update(temperature=0.0)
            prompt = draw.integers(5, 400, int(draw.integers(1, 14))).tolist()
            groups.append(SequenceGroup(f"r{round_}g{i}", prompt, SamplingParams(**kind), engine.table))
        return groups

    for engine in (eager, static):
        engine.start()
    try:
        for round_ in range(4):
            a, b = run(eager, mix(eager, round_)), run(static, mix(static, round_))
            for ga, gb in zip(a, b):
                for sa, sb in zip(ga.sequences, gb.sequences):
                    assert sa.token_ids == sb.token_ids, (round_, ga.request_id, sa.index)
                    assert np.allclose(sa.logprobs, sb.logprobs, atol=TOL)
                    assert [t.tolist() for t in sa.top_ids] == [t.tolist() for t in sb.top_ids]
                    for ta, tb in zip(sa.top_logprobs, sb.top_logprobs):
                        assert np.allclose(ta, tb, atol=TOL)
    finally:
        for engine in (eager, static):
            engine.stop()
    assert any(picked) and not all(picked)  # both the pick in the step and the engine's ran
    assert any(scattered)  # and some steps had a group's rows out of order in the batch
    assert all(e.runner.cache.matches(e.kv) and e.kv.is_consistent() for e in (static, eager))


def _cpp_compiler() -> bool:
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return bool(get_cpp_compiler())
    except Exception:
        return False


COMPILE_TESTED = torch.__version__ >= fixed_shape.COMPILE_MIN_TORCH
needs_compile_torch = pytest.mark.skipif(
    not COMPILE_TESTED, reason=f"compile_step refuses torch {torch.__version__} "
                               "(test_compile_step_refuses_an_untested_torch checks that)")


@pytest.mark.parametrize("version,refused", [("2.6.0", True), ("2.11.0+cu130", True), ("2.12.0", False),
                                             ("2.15.0", False)])
def test_compile_step_refuses_an_untested_torch(tiny_model, tokenizer, monkeypatch, version, refused):
    """Below the lowest torch its tests pass on, `compile_step` is refused when it is set, with the
    versions in the message, before any request could fail in a step; on the lowest end of the
    dependency ranges (tests/version_ranges.py) this runs against the real old torch too."""
    engine = Engine(tiny_model, tokenizer, "t", [], kv_cache_positions=8)
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion(version))
    if refused:
        with pytest.raises(RuntimeError, match=rf"needs torch >= 2\.12.*this is torch {re.escape(version)}"):
            engine.runner.fixed_shape.compile_step = "aot_eager"
        assert engine.runner.fixed_shape.compile_step is None
    else:
        engine.runner.fixed_shape.compile_step = "aot_eager"
        assert engine.runner.fixed_shape.compile_step == "aot_eager"
    monkeypatch.undo()
    if not COMPILE_TESTED:  # the real torch of this environment
        with pytest.raises(RuntimeError, match=re.escape(f"this is torch {torch.__version__}")):
            engine.runner.fixed_shape.compile_step = "aot_eager"


@needs_compile_torch
@pytest.mark.parametrize("kind,backend", [
    ("llama", "aot_eager"), ("gemma3", "aot_eager"),
    pytest.param("llama", "inductor", marks=pytest.mark.skipif(not _cpp_compiler(),
                                                               reason="Inductor on a CPU needs a C++ compiler"))])
def test_the_compiled_fixed_shape_step_answers_as_the_plain_one(kind, backend, tokenizer, reference_of, monkeypatch):
    """`compile_step` hands the whole fixed-shape pass to torch.compile as one graph (fullgraph: a graph
    break fails the step). "aot_eager": Dynamo's trace and functionalization (the cache writes become the
    graph's mutations of its inputs) without generating kernels; "inductor": the generated kernels (C++
    here, Triton on a GPU), fused, the sampler's 64-bit integer arithmetic included. Greedy and seeded
    rows, picks in the step and after it, batches of several padded sizes and spans: every token equals
    the plain fixed-shape step's, every log probability within 1e-5 of it and of a float64 forward."""
    model = build(kind, len(tokenizer))
    reference = reference_of(model)
    plain = Engine(model, tokenizer, "plain", [], kv_cache_positions=8)
    compiled = Engine(model, tokenizer, "compiled", [], kv_cache_positions=8)
    for engine in (plain, compiled):
        engine.runner.static_decode = True
    compiled.runner.fixed_shape.compile_step = backend
    traced = []
    real = torch.compile

    def counting(fn, **kwargs):  # the pass is traced by Dynamo: count the graphs it hands the backend
        named = torch._dynamo.lookup_backend(kwargs.pop("backend"))

        def counted(gm, inputs):
            traced.append(len(gm.graph.nodes))
            return named(gm, inputs)
        return real(fn, backend=counted, **kwargs)

    monkeypatch.setattr(torch, "compile", counting)
    try:
        for engine in (plain, compiled):
            engine.start()
        for round_ in range(2):
            a, b = run(plain, groups_of(plain)), run(compiled, groups_of(compiled))
            for ga, gb in zip(a, b):
                assert len(ga.sequences) == len(gb.sequences) > 0
                for sa, sb in zip(ga.sequences, gb.sequences):
                    assert sa.token_ids == sb.token_ids, (kind, round_, ga.request_id)
                    same_and_exact(sa, sb, gb, reference)
    finally:
        for engine in (plain, compiled):
            engine.stop()
    assert compiled.step_failures == 0 and plain.step_failures == 0
    # compiled at least once, as whole passes (hundreds of operations a graph, not fragments)
    assert traced and min(traced) > 100, traced
    assert all(e.runner.cache.matches(e.kv) and e.kv.is_consistent() for e in (compiled, plain))
