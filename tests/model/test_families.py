"""Model families of the lean runner (engine/runners/families/): tiny random-weight models of each family's own
transformers class, run through logprobe's Engine and checked against a float64 forward of
transformers' own implementation of that class (no cache): prompt passes, greedy and sampled generations
of several groups decoded in one batch, chunked prefill with a chunk boundary inside the sliding window,
and packed prefill of several prompts. Models no family runs (another architecture, or a configuration
its family refuses) run on transformers' forward and are checked the same way.

Every model but Llama and GPT-2 has a sliding window of 12 positions on some or all layers (Gemma 3:
sliding and full layers mixed, each with its own RoPE table), and prompts reach 40 tokens, so windows
are crossed in prompt passes, in prefill chunks and while decoding. Norm weights are random (not the initial ones or
zeros), so a norm read wrongly ((1 + w) against w, the query norm against the key norm) shows.

Tolerance: 1e-5 on log probabilities, as in the other engine tests. Both paths compute in float32 what
the reference computes in float64; for these 2-4 layer, 64-wide models float32 rounding moves a log
probability by at most 5e-6 (measured over this module on every model; `test_families_worst_error`
prints the largest difference per model and checks it), so 1e-5 leaves a 2x margin without hiding a
wrong mask, window, RoPE table, norm, scale, softcap or activation: each of those, put into the
runner or a family file on purpose, failed these tests.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading

import numpy as np
import pytest
import torch

from logprobe.engine.runners import int4, lean
from logprobe.engine.engine import Engine
from logprobe.engine.runners.families import family_of
from logprobe.engine.host.request import SamplingParams, SequenceGroup
from logprobe.engine.runners.model_runner import ModelRunner

TOL = 1e-5
WINDOW = 12
COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
WORST: dict[str, float] = {}  # family -> largest |lean - reference| seen


def build(kind: str, vocab: int, seed: int = 0):
    """A tiny random-weight model of `kind`'s transformers class, eval mode, random norm weights."""
    import transformers as tf

    if kind == "llama":
        cls, cfg = tf.LlamaForCausalLM, tf.LlamaConfig(vocab_size=vocab, num_hidden_layers=2, **COMMON)
    elif kind == "mistral":  # a window on every layer
        cls, cfg = tf.MistralForCausalLM, tf.MistralConfig(vocab_size=vocab, num_hidden_layers=2, sliding_window=WINDOW,
                                                           **COMMON)
    elif kind == "qwen2":  # q/k/v biases; layer 0 full, layers 1-2 sliding
        cls, cfg = tf.Qwen2ForCausalLM, tf.Qwen2Config(vocab_size=vocab, num_hidden_layers=3, use_sliding_window=True,
                                                       sliding_window=WINDOW, max_window_layers=1, **COMMON)
    elif kind in ("gemma3", "gemma3-softcap"):
        extra = dict(attn_logit_softcapping=20.0) if kind == "gemma3-softcap" else {}
        cls, cfg = tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(
            vocab_size=vocab, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
            final_logit_softcapping=3.0, tie_word_embeddings=True, **extra, **COMMON)
    elif kind == "qwen3":  # head_dim 32 with hidden 64 / 4 heads; layer 0 full, layers 1-2 sliding
        cls, cfg = tf.Qwen3ForCausalLM, tf.Qwen3Config(vocab_size=vocab, num_hidden_layers=3, head_dim=32,
                                                       use_sliding_window=True, sliding_window=WINDOW,
                                                       max_window_layers=1, tie_word_embeddings=False, **COMMON)
    elif kind in ("phi3", "phi3-partial", "phi3-longrope"):
        rope = {"rope_type": "default", "rope_theta": 10_000.0,
                "partial_rotary_factor": 0.5 if kind == "phi3-partial" else 1.0}
        if kind == "phi3-longrope":  # the 128k checkpoints' scaling (sequences here stay under 64 positions)
            rope.update(rope_type="longrope", short_factor=[1.0 + i / 8 for i in range(8)], long_factor=[4.0] * 8)
        cls, cfg = tf.Phi3ForCausalLM, tf.Phi3Config(vocab_size=vocab, num_hidden_layers=2, sliding_window=WINDOW,
                                                     rope_parameters=rope, original_max_position_embeddings=64,
                                                     tie_word_embeddings=False, **COMMON)
    elif kind == "gpt2":
        cls, cfg = tf.GPT2LMHeadModel, tf.GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                                     initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    model.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, module in model.named_modules():
        if "norm" in type(module).__name__.lower() and getattr(module, "weight", None) is not None:
            module.weight.add_(0.3 * torch.randn(module.weight.shape, generator=gen))
    return model


LEAN = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "gemma3": "gemma3", "qwen3": "qwen3", "phi3": "phi3"}
FALLBACK = {"gpt2": "no lean-runner family claims", "gemma3-softcap": "attention logit softcapping",
            "phi3-partial": "partial rotary", "phi3-longrope": "longrope"}


@pytest.fixture(scope="module")
def models(tokenizer, reference_of):
    cache = {}

    def get(kind):
        if kind not in cache:
            model = build(kind, len(tokenizer))
            cache[kind] = (model, reference_of(model))
        return cache[kind]

    return get


def engine_for(kind, models, tokenizer) -> tuple[Engine, object]:
    model, reference = models(kind)
    engine = Engine(copy.deepcopy(model), tokenizer, f"test/{kind}")
    return engine, reference


def run(engine, groups):
    asyncio.run(engine.run_groups(groups))
    return groups


def make(engine, ids, **params):
    return SequenceGroup("t", list(ids), SamplingParams(**params), engine.table)


def prompt(length: int, start: int = 300) -> list[int]:
    gen = np.random.default_rng(start + length)
    return [1] + [int(t) for t in gen.integers(3, 40_000, length - 1)]


def note(kind, got, want):
    diff = float(np.max(np.abs(np.asarray(got, dtype=np.float64) - np.asarray(want, dtype=np.float64)), initial=0))
    WORST[kind] = max(WORST.get(kind, 0.0), diff)
    return diff


def check_prompt_columns(kind, g, reference, k: int = 0):
    cols, ids = g.prompt_columns, g.prompt_ids
    ref = reference.logprobs(ids).numpy()
    want = [ref[i - 1][ids[i]] for i in range(1, len(ids))]
    assert note(kind, cols.logprobs[1:], want) < TOL, (kind, len(ids))
    for i in range(1, len(ids)):
        lo, hi = reference.rank_bounds(ref[i - 1], ids[i])
        assert lo <= cols.ranks[i] <= hi
    if k:
        top = np.sort(ref[:-1], axis=1)[:, ::-1][:, :k]
        assert note(kind, cols.top_logprobs[1:], top) < TOL
    return ref


def check_sequences(kind, g, reference, k: int = 0):
    """Each choice's tokens and log probabilities against the reference recomputed on prompt + generated;
    greedy choices took the likeliest token (up to float32 near-ties)."""
    p = len(g.prompt_ids)
    for s in g.sequences:
        assert s.token_ids, "nothing generated"
        ref = reference.logprobs(g.prompt_ids + s.token_ids).numpy()
        want = [ref[p - 1 + i][t] for i, t in enumerate(s.token_ids)]
        assert note(kind, s.logprobs, want) < TOL, (kind, p, s.index)
        if g.params.is_greedy:
            for i, t in enumerate(s.token_ids):
                row = ref[p - 1 + i]
                assert row[t] >= row.max() - 2 * TOL
        if k:
            top = np.stack(s.top_logprobs)[:, :k]
            want_top = np.sort(ref[p - 1:-1], axis=1)[:, ::-1][:len(s.token_ids), :k]
            assert note(kind, top, want_top) < TOL


# ---- which path -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(LEAN))
def test_family_runs_on_the_lean_path(kind, models, tokenizer):
    engine, reference = engine_for(kind, models, tokenizer)
    assert engine.info.runner == "lean"
    # transformers' own forward still works on the fused weights (views): activations use it
    ids = prompt(20)
    with torch.inference_mode():
        logits = engine.model(torch.tensor([ids])).logits[0]
    assert note(kind, torch.log_softmax(logits.double(), -1).numpy(), reference.logprobs(ids).numpy()) < TOL
    assert isinstance(engine.runner, lean.LeanRunner) and engine.runner.family.name == LEAN[kind]
    windows = engine.runner.windows
    types = getattr(engine.model.config, "layer_types", None)
    if kind == "llama":
        assert windows == [None] * 2
    elif kind in ("mistral", "phi3"):
        assert windows == [WINDOW] * len(windows)
    else:  # per layer type
        assert windows == [WINDOW if t == "sliding_attention" else None for t in types]
        assert None in windows and WINDOW in windows


@pytest.mark.parametrize("kind", list(FALLBACK))
def test_other_models_run_on_transformers(kind, models, tokenizer, caplog):
    model, _ = models(kind)
    family, reason = family_of(model)
    assert family is None and FALLBACK[kind] in reason
    with caplog.at_level(logging.INFO, logger="logprobe.engine"):
        engine = Engine(copy.deepcopy(model), tokenizer, f"test/{kind}")
    assert engine.info.runner == "transformers" and type(engine.runner).__name__ == "ModelRunner"
    assert any(FALLBACK[kind] in r.getMessage() for r in caplog.records)  # the reason is logged
    with pytest.raises(ValueError, match="lean runner cannot run"):
        lean.LeanRunner(copy.deepcopy(model))


# ---- the same checks on both paths ------------------------------------------------------------------
ALL = list(LEAN) + list(FALLBACK)


@pytest.mark.parametrize("kind", ALL)
def test_prompt_passes(kind, models, tokenizer):
    """Prompt-only groups (echo scoring, prompt_logprobs) of lengths either side of the window, in one
    batch (the lean runner's padded pass), and alone."""
    engine, reference = engine_for(kind, models, tokenizer)
    engine.start()
    try:
        prompts = [prompt(40), prompt(7), prompt(2), prompt(25)]
        groups = run(engine, [make(engine, p, max_tokens=0, echo=True, logprobs=4) for p in prompts])
        for g in groups:
            check_prompt_columns(kind, g, reference, k=4)
        alone, = run(engine, [make(engine, prompt(33), max_tokens=0, prompt_logprobs=3)])
        check_prompt_columns(kind, alone, reference, k=3)
    finally:
        engine.stop()


@pytest.mark.parametrize("kind", ALL)
def test_batched_decode_of_several_groups(kind, models, tokenizer, monkeypatch):
    """Greedy and sampled (n = 2) groups of different prompt lengths decoded together: rows at different
    positions (the length mask and the window mask), crossing the window while decoding; the prompts,
    arriving together, are prefilled in one packed pass on the lean runner."""
    engine, reference = engine_for(kind, models, tokenizer)
    packed = []
    real = engine.runner.prefill_chunks
    monkeypatch.setattr(engine.runner, "prefill_chunks", lambda chunks: (packed.append(len(chunks)), real(chunks))[1])
    engine.start()
    try:
        groups = [make(engine, prompt(5), max_tokens=18, temperature=0, logprobs=3, echo=True),
                  make(engine, prompt(9), max_tokens=14, n=2, temperature=1.0, seed=7, logprobs=2),
                  make(engine, prompt(30), max_tokens=10, temperature=0, logprobs=3, prompt_logprobs=2)]
        before = engine.num_steps
        run(engine, groups)
        steps = engine.num_steps - before
        for g in groups:
            check_sequences(kind, g, reference, k=g.params.logprobs)
            if g.prompt_columns is not None:
                check_prompt_columns(kind, g, reference)
        if engine.info.runner == "lean":
            assert max(packed) >= 2  # prompts packed into one pass
            assert steps <= 1 + 18 + 1  # one prefill step, then shared decode steps
        # alone: every row in step (the lean runner reads just the window's keys, no mask)
        g, = run(engine, [make(engine, prompt(8), max_tokens=2 * WINDOW, temperature=0, logprobs=2)])
        check_sequences(kind, g, reference, k=2)
    finally:
        engine.stop()


@pytest.mark.parametrize("kind", ALL)
def test_chunked_prefill_across_the_window(kind, models, tokenizer, monkeypatch):
    """A 40-token prompt prefilled in chunks of 5 (boundaries at 10 and 15 sit inside a 12-token window of
    later queries) beside a decoding request; its prompt log probabilities and generation against the
    reference. On the lean runner the chunks are checked to have happened."""
    engine, reference = engine_for(kind, models, tokenizer)
    if engine.info.runner == "lean":
        monkeypatch.setattr(engine.scheduler, "prefill_chunk_tokens", 5)
    budgets = []
    real = engine.runner.prefill_chunks
    monkeypatch.setattr(engine.runner, "prefill_chunks",
                        lambda chunks: (budgets.extend(b for _, b in chunks), real(chunks))[1])
    if engine.info.runner == "lean":  # chunks beside decoding rows run in their pass (decode_with_prefill)
        merged = engine.runner.decode_with_prefill
        monkeypatch.setattr(engine.runner, "decode_with_prefill",
                            lambda groups, chunks: (budgets.extend(b for _, b in chunks), merged(groups, chunks))[1])
    short = make(engine, prompt(4), max_tokens=40, temperature=0, logprobs=1)
    long = make(engine, prompt(40), max_tokens=6, temperature=0, logprobs=2, echo=True)

    # the short request's first step holds the engine thread until the long prompt is queued: it is then
    # prefilled beside the short one's decoding, however fast either runs
    short_decoding, long_queued = threading.Event(), threading.Event()

    def on_step(group):
        if len(group.sequences[0].token_ids) == 1:
            short_decoding.set()
            long_queued.wait(600)

    short.on_step = on_step

    async def both():
        first = engine.submit([short])
        while not short_decoding.is_set():
            await asyncio.sleep(0.001)
        later = engine.submit([long])
        long_queued.set()
        await asyncio.gather(*first, *later)

    engine.start()
    try:
        asyncio.run(both())
    finally:
        engine.stop()
    check_prompt_columns(kind, long, reference, k=2)
    check_sequences(kind, long, reference, k=2)
    check_sequences(kind, short, reference, k=1)
    if engine.info.runner == "lean":
        assert budgets.count(5) >= 40 // 5 - 1  # the long prompt went in chunks of 5


@pytest.mark.parametrize("kind", list(LEAN))
def test_chunks_and_packed_prefill_directly(kind, models, tokenizer):
    """The lean runner's prefill entry points called directly (the engine not started, so the chunks are
    exactly these): one prompt in chunks of 7 (boundary 14 inside the window of positions 15..25), then
    three prompts packed into one pass, one of them only partly, finished by plain chunks."""
    engine, reference = engine_for(kind, models, tokenizer)
    runner = engine.runner
    g = make(engine, prompt(40), max_tokens=1, prompt_logprobs=2)
    logprobs, steps = None, 0
    while logprobs is None:
        logprobs = runner.prefill_chunk(g, 7)
        steps += 1
    assert steps == 6
    g.prompt_columns = runner.prompt_columns(g)  # handed over once the prompt is done (the core writes them)
    ref = check_prompt_columns(kind, g, reference, k=2)
    assert note(kind, logprobs[0].numpy(), ref[-1]) < TOL
    runner.release(g)

    runner.prefix_cache.clear()  # the prompt of 40 ran above: its kept blocks would shorten these chunks
    groups = [make(engine, prompt(n), max_tokens=1, prompt_logprobs=1) for n in (6, 19, 40)]
    out = runner.prefill_chunks([(groups[0], 100), (groups[1], 100), (groups[2], 23)])
    assert out[2] is None and runner.prefill_state(groups[2]).done == 23
    while out[2] is None:
        out[2] = runner.prefill_chunk(groups[2], 8)
    for g, logprobs in zip(groups, out):
        g.prompt_columns = runner.prompt_columns(g)
        ref = check_prompt_columns(kind, g, reference, k=1)
        assert note(kind, logprobs[0].numpy(), ref[-1]) < TOL
        runner.release(g)


@pytest.mark.parametrize("kind", ["gemma3", "qwen3", "phi3"])
def test_bfloat16(kind, models, tokenizer, monkeypatch):
    """In bfloat16 (what `--dtype auto` gives on CPUs with bfloat16 arithmetic): the pre-packed weights
    give the plain product's numbers, and both stay within bfloat16's error of the float64 reference."""
    model, reference = models(kind)
    engines = {"packed": Engine(copy.deepcopy(model).to(torch.bfloat16), tokenizer, "packed")}
    monkeypatch.setattr(lean.runner, "packing_works", lambda dtype, device: False)
    engines["plain"] = Engine(copy.deepcopy(model).to(torch.bfloat16), tokenizer, "plain")
    assert not engines["plain"].runner.packed
    assert engines["packed"].info.runner == engines["plain"].info.runner == "lean"
    out = {}
    for name, engine in engines.items():
        engine.start()
        try:
            out[name] = run(engine, [make(engine, prompt(n), max_tokens=6, temperature=0, logprobs=3, echo=True)
                                     for n in (5, 18, 30)])
        finally:
            engine.stop()
    for a, b in zip(out["packed"], out["plain"]):
        if engines["packed"].runner.packed:
            assert a.sequences[0].token_ids == b.sequences[0].token_ids
            assert a.sequences[0].logprobs == b.sequences[0].logprobs
            np.testing.assert_array_equal(a.prompt_columns.logprobs, b.prompt_columns.logprobs)
        ids = a.prompt_ids + a.sequences[0].token_ids
        ref = reference.logprobs(ids).numpy()
        p = len(a.prompt_ids)
        want = [ref[p - 1 + i][t] for i, t in enumerate(a.sequences[0].token_ids)]
        np.testing.assert_allclose(a.sequences[0].logprobs, want, atol=0.1)  # bfloat16's error
        np.testing.assert_allclose(a.prompt_columns.logprobs[1:], [ref[i - 1][ids[i]] for i in range(1, p)], atol=0.1)


def reference_activations(reference, ids, layers):
    """transformers' own forward in float64, read by hooks (ModelRunner.residual_stream)."""
    return ModelRunner(reference.model).residual_stream(ids, layers)


@pytest.mark.parametrize("kind", list(LEAN))
def test_activations_on_the_lean_path(kind, models, tokenizer):
    """The lean runner reads the residual stream itself (entering block 0, leaving each block, before the
    final norm), past a sliding window, as transformers' float64 forward gives it."""
    engine, reference = engine_for(kind, models, tokenizer)
    num_layers = engine.info.num_layers
    ids = prompt(40)
    got = engine.runner.residual_stream(ids, [0, 1, num_layers])
    want = reference_activations(reference, ids, [0, 1, num_layers])
    assert sorted(got) == [0, 1, num_layers]
    for layer in got:
        assert got[layer].shape == (len(ids), engine.info.d_model) and got[layer].dtype == np.float32
        scale = float(np.abs(want[layer]).max())
        assert note(kind, got[layer] / scale, want[layer] / scale) < 1e-5, layer
    # the pass stops after the deepest asked layer, and asks for one layer only
    assert sorted(engine.runner.residual_stream(ids, [1])) == [1]


@pytest.mark.parametrize("kind", ["llama", "gemma3", "phi3"])
def test_bfloat16_keeps_each_weight_once(kind, models, tokenizer, monkeypatch):
    """Packed for oneDNN, each projection (and an untied head) is held once: transformers' copies are
    released, with the same numbers as an engine that keeps them, and activations still read."""
    model, reference = models(kind)
    engine = Engine(copy.deepcopy(model).to(torch.bfloat16), tokenizer, "released")
    if not engine.runner.packed:
        pytest.skip("no oneDNN packing for bfloat16 on this CPU")
    with monkeypatch.context() as m:
        m.setattr(lean.LeanRunner, "RELEASE_PACKED", False)
        kept = Engine(copy.deepcopy(model).to(torch.bfloat16), tokenizer, "kept")
    layers = engine.model.get_decoder().layers
    linears = [mod for mod in layers.modules() if isinstance(mod, torch.nn.Linear)]
    assert linears and all(mod.weight.numel() == 0 for mod in linears)
    tied = kept.model.get_output_embeddings().weight is kept.model.get_input_embeddings().weight
    head = engine.model.get_output_embeddings().weight
    assert head is engine.model.get_input_embeddings().weight if tied else head.numel() == 0
    assert engine.model.get_input_embeddings().weight.numel() > 0  # the lean runner embeds with it
    # what the engine holds: the packed projections and head, the embedding, the norms; once each
    held = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    held += sum(lin.packed.numel() * lin.packed.element_size()
                for block in engine.runner.blocks for lin in block.linears) + engine.runner.head.packed.nbytes
    weights = sum(p.numel() * p.element_size() for p in kept.model.parameters())
    extra = engine.runner.head.packed.nbytes if tied else 0  # a tied head's packed copy
    assert held <= weights + extra + 1024
    blocks = sum(lin.packed.nbytes for block in kept.runner.blocks for lin in block.linears)
    kept_held = weights + blocks + kept.runner.head.packed.nbytes
    assert held < kept_held - 0.9 * blocks  # the blocks' own copies are gone
    num_layers = engine.info.num_layers
    out = {}
    for name, eng in (("released", engine), ("kept", kept)):
        eng.start()
        try:
            out[name] = run(eng, [make(eng, prompt(n), max_tokens=5, temperature=0, logprobs=3, echo=True,
                                       residual_layers=(0, 2, num_layers)) for n in (5, 30)])
        finally:
            eng.stop()
    for a, b in zip(out["released"], out["kept"]):
        assert a.sequences[0].token_ids == b.sequences[0].token_ids
        assert a.sequences[0].logprobs == b.sequences[0].logprobs
        np.testing.assert_array_equal(a.prompt_columns.logprobs, b.prompt_columns.logprobs)
        ids = a.prompt_ids + a.sequences[0].token_ids
        want = reference_activations(reference, ids, [0, 2, num_layers])
        for layer, got in a.sequences[0].residual.items():
            scale = float(np.abs(want[layer]).max())
            np.testing.assert_allclose(got / scale, want[layer] / scale, atol=0.06)  # bfloat16 over the blocks
            np.testing.assert_array_equal(got, b.sequences[0].residual[layer])


@pytest.mark.skipif(not int4.available(), reason="no CPU int4 kernel in this torch")
@pytest.mark.parametrize("kind", ["gemma3", "qwen3"])
def test_int4_decode(kind, models, tokenizer, reference_of):
    """`--quantization int4` on a family with Llama's projection names: decode steps read the
    4-bit grids (bfloat16-sized differences), prefill stays float32 (exact)."""
    model = copy.deepcopy(models(kind)[0])
    gen = torch.Generator().manual_seed(3)
    for name, module in model.named_modules():  # snap the block projections to a Q4_1-style grid
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
            n, k = module.weight.shape
            q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
            q[..., 0], q[..., 1] = 0, 15
            d = (torch.rand(n, k // 32, 1, generator=gen) * 0.02 + 0.005).half().float()
            module.weight.copy_((q * d - 7.5 * d).reshape(n, k))
    reference = reference_of(model)
    model.logprobe_int4 = int4.decoder_grids(model)
    engine = Engine(model, tokenizer, "q4")
    assert engine.info.runner == "lean" and engine.runner.int4
    engine.start()
    try:
        g, = run(engine, [make(engine, prompt(9), max_tokens=2 * WINDOW, temperature=0, logprobs=1)])
    finally:
        engine.stop()
    seq = g.sequences[0]
    ref = reference.logprobs(g.prompt_ids + seq.token_ids).numpy()
    want = np.array([ref[len(g.prompt_ids) - 1 + i][t] for i, t in enumerate(seq.token_ids)])
    diff = np.abs(np.array(seq.logprobs) - want)
    assert diff[0] < TOL  # from the float32 prefill
    assert 0 < diff[1:].max() < 0.05  # 4-bit decode steps: bfloat16-sized, and not the float32 numbers


def test_families_worst_error():
    """The largest difference from the float64 reference per family over this module (see the tolerance
    note at the top); run last."""
    if not WORST:
        pytest.skip("run with the rest of the module")
    print("worst |lean or transformers - float64| per model:",
          {k: f"{v:.1e}" for k, v in sorted(WORST.items())})
    assert max(WORST.values()) < TOL
