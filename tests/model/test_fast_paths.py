"""The speed paths of the lean runner, checked against the float64 reference: bfloat16 with pre-packed
weights (same numbers as the plain product), the padded prompt-only pass, and 4-bit decode weights
(`--quantization int4`)."""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch

from logprobe.engine.runners import int4, lean, loader
from logprobe.engine.engine import Engine
from logprobe.engine.host.request import SamplingParams, SequenceGroup


def run(engine, groups):
    asyncio.run(engine.run_groups(groups))
    return groups


def make(engine, ids, **params):
    return SequenceGroup("t", list(ids), SamplingParams(**params), engine.table)


def on_grid(model, seed: int = 1):
    """A copy of `model` whose block projections are snapped to a Q4_1-style grid: per row and group of
    32 columns, w = d * q + m with q in 0..15 and d, m float16 (what a Q4_1 GGUF dequantizes to)."""
    model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
            n, k = module.weight.shape
            q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
            q[..., 0], q[..., 1] = 0, 15  # both ends used, as llama.cpp's quantizer does
            d = (torch.rand(n, k // 32, 1, generator=gen) * 0.02 + 0.005).half().float()
            m = (-7.5 * d + (torch.rand(n, k // 32, 1, generator=gen) - 0.5) * 0.01).half().float()
            module.weight.copy_((q * d + m).reshape(n, k))
    return model


# ---- 4-bit grids ---------------------------------------------------------------------------------
def test_grid_found_exactly_and_refused_off_grid():
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (48, 4, 32), generator=gen).float()
    q[..., 0], q[..., -1] = 0, 15
    d = (torch.rand(48, 4, 1, generator=gen) * 0.1).half().float()
    m = (torch.randn(48, 4, 1, generator=gen) * 0.1).half().float()
    w = (q * d + m).reshape(48, 128)
    grid = int4.grid_of(w)
    assert grid is not None
    assert torch.equal(grid.q.reshape(48, 4, 32).float(), q)
    back = grid.q.reshape(48, 4, 32).float() * grid.scale[..., None] + grid.offset[..., None]
    assert torch.equal(back.reshape(48, 128), w)
    assert int4.grid_of(torch.randn(48, 128, generator=gen)) is None  # not 4-bit
    off = w.clone()
    off[3, 70] += d[3, 2, 0] * 0.3  # one value between two grid points
    assert int4.grid_of(off) is None
    assert int4.grid_of(torch.zeros(4, 40)) is None  # columns not in groups of 32


@pytest.mark.skipif(not int4.available(), reason="no CPU int4 kernel in this torch")
def test_int4_product_against_float64():
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (96, 6, 32), generator=gen).float()
    q[..., 0], q[..., -1] = 0, 15
    d = (torch.rand(96, 6, 1, generator=gen) * 0.05).half().float()
    m = (-8 * d).half().float()
    w = (q * d + m).reshape(96, 192)
    lin = int4.Int4Linear([int4.grid_of(w[:40]), int4.grid_of(w[40:])])  # stacked like q/k/v
    x = torch.randn(5, 192, generator=gen)
    want = x.double() @ w.double().T
    got = lin(x)
    assert got.dtype == torch.float32 and got.shape == (5, 96)
    # bfloat16 inputs, scales and output: relative error a few 2^-9
    assert (got.double() - want).abs().max() <= 0.01 * want.abs().max()
    # the decode rows' own case (2-D, already bfloat16: no reshape, no cast) gives the general path's bits
    rows = x.bfloat16()
    direct = lin(rows)
    assert direct.dtype == torch.bfloat16 and direct.shape == (5, 96)
    assert torch.equal(direct, lin(rows[None])[0]) and torch.equal(direct.float(), got)


# ---- bfloat16: packed weights give the plain product's numbers --------------------------------------
@pytest.mark.skipif(not lean.packing_works(torch.bfloat16, torch.device("cpu")),
                    reason="no oneDNN weight packing for bfloat16 here")
def test_packed_bfloat16_equals_plain(tiny_model, tokenizer, reference, monkeypatch):
    model = copy.deepcopy(tiny_model).to(torch.bfloat16)
    packed = Engine(model, tokenizer, "packed")
    monkeypatch.setattr(lean.runner, "packing_works", lambda dtype, device: False)
    plain = Engine(copy.deepcopy(tiny_model).to(torch.bfloat16), tokenizer, "plain")
    assert packed.runner.packed and not plain.runner.packed
    for engine in (packed, plain):
        engine.start()
    try:
        prompts = [[1, 5, 9, 20, 33], [1, 7, 7], [1, 40, 41, 42, 43, 44, 45, 46, 47]]
        a = run(packed, [make(packed, p, max_tokens=6, temperature=0, logprobs=3, echo=True) for p in prompts])
        b = run(plain, [make(plain, p, max_tokens=6, temperature=0, logprobs=3, echo=True) for p in prompts])
        for ga, gb in zip(a, b):
            assert ga.sequences[0].token_ids == gb.sequences[0].token_ids
            assert ga.sequences[0].logprobs == gb.sequences[0].logprobs
            np.testing.assert_array_equal(ga.prompt_columns.logprobs, gb.prompt_columns.logprobs)
            ref = reference.logprobs(ga.prompt_ids + ga.sequences[0].token_ids).numpy()
            want = [ref[len(ga.prompt_ids) - 1 + i][t] for i, t in enumerate(ga.sequences[0].token_ids)]
            np.testing.assert_allclose(ga.sequences[0].logprobs, want, atol=0.1)  # bfloat16's error
    finally:
        packed.stop()
        plain.stop()


# ---- the padded prompt-only pass of the lean runner ------------------------------------------------
def test_prompt_only_batch_of_unequal_lengths(tiny_model, tokenizer, reference):
    """One padded pass of the lean runner for four prompts of different lengths (called directly, so
    that the batch is exactly these four), checked against the float64 reference."""
    engine = Engine(copy.deepcopy(tiny_model), tokenizer, "padded")  # not started: the runner is ours
    assert isinstance(engine.runner, lean.LeanRunner)
    prompts = [[1, 5, 9, 20, 33, 34, 35], [1, 7], [1, 40, 41, 42], list(range(3, 60))]
    groups = [make(engine, p, max_tokens=0, echo=True, logprobs=4) for p in prompts]
    engine.runner.prefill_batch(groups)
    for g in groups:
        g.prompt_columns = engine.runner.prompt_columns(g)  # what the engine's core does with them
        ref = reference.logprobs(g.prompt_ids).numpy()
        ids = g.prompt_ids
        np.testing.assert_allclose(g.prompt_columns.logprobs[1:], [ref[i - 1][ids[i]] for i in range(1, len(ids))],
                                   atol=1e-5)
        top = np.sort(ref[:-1], axis=1)[:, ::-1][:, :4]
        np.testing.assert_allclose(g.prompt_columns.top_logprobs[1:], top, atol=1e-5)
        for i in range(1, len(ids)):
            lo, hi = reference.rank_bounds(ref[i - 1], ids[i])
            assert lo <= g.prompt_columns.ranks[i] <= hi


# ---- 4-bit decode weights --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def grid_model(tiny_model):
    return on_grid(tiny_model)


@pytest.mark.skipif(not int4.available(), reason="no CPU int4 kernel in this torch")
def test_int4_decode_against_float64(grid_model, tokenizer, reference_of):
    model = copy.deepcopy(grid_model)
    model.logprobe_int4 = int4.decoder_grids(model)
    engine = Engine(model, tokenizer, "q4")
    assert engine.info.quantization == "int4" and engine.runner.int4
    reference = reference_of(grid_model)
    engine.start()
    try:
        prompts = [[1, 5, 9, 20, 33], [1, 7, 7], [1, 40, 41, 42, 43, 44, 45, 46, 47]]
        groups = run(engine, [make(engine, p, max_tokens=12, temperature=0, logprobs=3, echo=True) for p in prompts])
        worst = 0.0
        for g in groups:
            seq = g.sequences[0]
            ref = reference.logprobs(g.prompt_ids + seq.token_ids).numpy()
            # prompt passes stay float32: exact
            ids = g.prompt_ids
            np.testing.assert_allclose(g.prompt_columns.logprobs[1:], [ref[i - 1][ids[i]] for i in range(1, len(ids))],
                                       atol=1e-5)
            want = np.array([ref[len(ids) - 1 + i][t] for i, t in enumerate(seq.token_ids)])
            # the first token comes from the (float32) prefill; the others from 4-bit decode steps
            assert abs(seq.logprobs[0] - want[0]) < 1e-5
            worst = max(worst, float(np.abs(np.array(seq.logprobs) - want).max()))
            for i, t in enumerate(seq.token_ids):  # greedy: the likeliest by the reference, up to near-ties
                row = ref[len(ids) - 1 + i]
                assert row[t] >= row.max() - 0.05
        assert 0 < worst < 0.05  # bfloat16-sized, and not the float32 numbers
    finally:
        engine.stop()


@pytest.mark.skipif(not int4.available(), reason="no CPU int4 kernel in this torch")
def test_int4_loading_refuses_weights_off_grid(tiny_model, tokenizer, tmp_path):
    tiny_model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    source = loader.resolve_source(str(tmp_path))
    with pytest.raises(loader.ModelLoadError, match="4-bit weights .*layers.0.self_attn.q_proj is not on a 4-bit grid"):
        loader.load(source, "float32", quantization="int4")
    on_grid(tiny_model).save_pretrained(tmp_path)
    model, _ = loader.load(source, "bfloat16", quantization="int4")
    assert next(model.parameters()).dtype == torch.bfloat16 and len(model.logprobe_int4) == 2 * 7
    # the parameters are cast, not the buffers: RoPE's frequencies stay float32, as in a bfloat16 load
    assert all(b.dtype == torch.float32 for b in model.buffers())
    assert all(b.dtype == torch.float32 for b in loader.load(source, "bfloat16")[0].buffers())
    plain, _ = loader.load(source, "float32")
    assert plain.logprobe_int4 is None


def test_int4_needs_a_supported_model(tokenizer, tiny_model_factory):
    model = tiny_model_factory(len(tokenizer))
    model.logprobe_int4 = {}
    with pytest.raises(ValueError, match="lean runner"):
        Engine(model, tokenizer, "x", fast=False)


# ---- the bundled model, as `logprobe serve --quantization int4` loads it -------------------------------
@pytest.mark.skipif(not int4.available(), reason="no CPU int4 kernel in this torch")
def test_bundled_model_int4_against_float32(tokenizer):
    from logprobe.cli import build_parser, settings_from_args

    settings = settings_from_args(build_parser().parse_args(["serve", "--quantization", "int4"]))
    assert settings.quantization == "int4"
    source = loader.resolve_source(None)
    q4_model, tok = loader.load(source, "float32", quantization=settings.quantization)
    assert len(q4_model.logprobe_int4) == 30 * 7  # every projection of the Q4_1 file is on its grid
    q4 = Engine(q4_model, tok, "q4")
    f32_model, _ = loader.load(source, "float32")
    f32 = Engine(f32_model, tok, "f32")
    prompt = tok("1, 2, 3, 4, 5, 6, 7, 8, 9, 10,").input_ids
    for engine in (q4, f32):
        engine.start()
    try:
        a, = run(q4, [make(q4, prompt, max_tokens=16, temperature=0, logprobs=5)])
        b, = run(f32, [make(f32, prompt, max_tokens=16, temperature=0, logprobs=5)])
    finally:
        q4.stop()
        f32.stop()
    assert a.sequences[0].token_ids == b.sequences[0].token_ids  # counting on: no near-ties
    diff = np.abs(np.array(a.sequences[0].logprobs) - np.array(b.sequences[0].logprobs))
    assert diff[0] < 1e-5  # the first token comes from the float32 prefill
    assert 0 < diff[1:].max() < 0.1  # 4-bit decode steps: bfloat16-sized differences
    np.testing.assert_allclose(np.stack(a.sequences[0].top_logprobs), np.stack(b.sequences[0].top_logprobs), atol=0.15)


# ---- attention masks: additive, made once per pass ------------------------------------------------
@pytest.mark.parametrize("static", [False, True])
def test_masks_are_made_additive_once_with_the_boolean_masks_numbers(static, tokenizer, monkeypatch):
    """SDPA turns a boolean mask into an additive one on every call, once per layer (a kernel per
    layer on a GPU, inside the recorded decode step too); the lean runner hands it the additive masks,
    made once per pass. Every masked pass (chunked prompts, prompts sharing a prefix, batched chunks
    beside decoding rows, decode rows at different lengths, the fixed-shape step, sliding windows)
    must give the numbers the boolean masks give, bit for bit."""
    from test_families import build

    model = build("gemma3", len(tokenizer))  # sliding-window layers: a band mask per window too
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        seen.append(None if attn_mask is None else attn_mask.dtype)
        return real(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)

    def workload(engine):
        engine.runner.static_decode = static
        engine.scheduler.prefill_chunk_tokens = 7  # long prompts arrive in chunks, beside decoding rows
        shared = engine.tokenizer("A long shared context about rivers and the stones in them, twice over").input_ids
        groups = [make(engine, ids, max_tokens=m, temperature=t, seed=3, n=n, logprobs=2)
                  for ids, m, t, n in [([1, 5], 14, 0.0, 1), (list(range(40, 71)), 9, 1.0, 2),
                                       ([1, 7, 9, 11, 13], 12, 0.7, 1)]]
        groups += [make(engine, shared + [60 + i] * (i + 1), max_tokens=0, echo=True, logprobs=1,
                        prompt_logprobs=2) for i in range(3)]
        run(engine, groups)
        out = [(list(s.token_ids), np.asarray(s.logprobs).tolist(), [np.asarray(t).tolist() for t in s.top_logprobs])
               for g in groups for s in g.sequences]
        return out + [np.asarray(g.prompt_columns.logprobs).tolist() for g in groups if g.prompt_columns is not None]

    engine = Engine(model, tokenizer, "additive", [], kv_cache_positions=16)
    engine.start()
    try:
        got = workload(engine)
    finally:
        engine.stop()
    masked = [dtype for dtype in seen if dtype is not None]
    assert masked and set(masked) == {torch.float32}, set(masked)  # no boolean mask reaches SDPA
    seen.clear()
    boolean = Engine(model, tokenizer, "boolean", [], kv_cache_positions=16)
    monkeypatch.setattr(boolean.runner.attention, "additive", lambda masks: masks)
    boolean.start()
    try:
        want = workload(boolean)
    finally:
        boolean.stop()
    assert torch.bool in seen  # the comparison did run the boolean masks
    np.testing.assert_equal(got, want)  # exactly (a prompt's first position: NaN in both)


@pytest.mark.skipif(not int4.available(), reason="no CPU int4 kernel in this torch")
def test_a_pass_of_decode_rows_and_prompt_rows_reads_each_kinds_weights_once():
    """`Linear` with a 4-bit form, called for 3 decode rows and 4 prompt rows in one pass (int4_rows=3):
    the decode rows have the bits of a 4-bit call alone, the prompt rows those of a dense call alone, and
    both are the float64 product of the weights plus the bias once (bfloat16's error, not a second bias)."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (96, 64), generator=gen, dtype=torch.uint8)
    scale = torch.rand(96, 2, generator=gen) * 0.02
    w = (q.float() - 7.5) * scale.repeat_interleave(32, 1)
    bias = torch.randn(96, generator=gen)
    lin = lean.weights.Linear(w.bfloat16(), bias.bfloat16(), pack=lean.packing_works(torch.bfloat16, torch.device("cpu")),
                              int4=int4.Int4Linear([int4.Grid(q, scale, -7.5 * scale)]))
    x = torch.randn(7, 64, generator=gen).bfloat16()
    with torch.inference_mode():
        mixed = lin(x, 3)
        assert torch.equal(mixed[:3], lin(x[:3], 3)) and torch.equal(mixed[3:], lin(x[3:]))
    want = x.double() @ w.double().T + bias.double()
    assert float((mixed.double() - want).abs().max()) < 0.05  # a second bias would be ~1 off
