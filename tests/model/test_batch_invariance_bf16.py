"""`--dtype bfloat16` (without int4) gives a request the same bits beside anything, on a CPU whose
packed bfloat16 product gives a row the same bits in calls of 2 rows or more (an AMD EPYC, measured;
not the Intel Xeon measured, where calls of 33-600 rows take another path: docs/performance.md). The
tests of test_batch_invariance.py on bfloat16 tiny models (a generation beside 1, 5 and 16 decoding
others; a scored text and a generation's prompt beside 1, 7, 24 and 63 requests of every kind, with and
without the prefix cache, prompts cut in chunks of 40 tokens), and SmolLM2 itself in bfloat16 with 2
threads (a greedy and a seeded sampled generation beside 1 and 16 others); every number compared bit
for bit with the request alone. Where this CPU's bfloat16 product is not row-invariant from 2 rows
(probed first, on the models' shapes), the tests skip and say so.

What it rests on, besides the product: a call of 1 row padded to 2 where the weight's shape takes
another path for one row (`row_floors.packed_floor`: on the EPYC a row of SmolLM2's `down_proj` came
out one bfloat16 unit apart alone), SDPA's query floor and short block taken
from the float32 probes (row_floors; test_attention_reads.py runs the kernel property in bfloat16), and
the top-k ids in one order among equal values (engine/device/top_k.py; ties are common among bfloat16
log probabilities, and torch.topk alone ordered them otherwise as the call's row count changed).

Slow: the prompt test runs 190 requests of every kind, as the float32 one (about 20 s on 2 vCPUs, so
Llama only: Gemma 3's sliding windows and head size 16 are in the generation test), and SmolLM2's runs
68 generations on the real model (about 12 s)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import test_batch_invariance as float32_tests
from logprobe.engine.engine import Engine
from logprobe.engine.runners import loader
from logprobe.engine.runners.lean.row_floors import _classes, _floor
from test_families import COMMON, build

BF16_TOL = 0.1  # against the float64 forward: bfloat16 keeps 8 significant bits


@functools.cache
def bf16_product_rows_invariant(vocab: int) -> bool:
    """Whether the packed bfloat16 product (what the lean runner runs in bfloat16 on a CPU) gives a probe
    row the same bits in calls of 2 to 600 rows, at the test models' weight shapes."""
    hidden, inner = COMMON["hidden_size"], COMMON["intermediate_size"]
    counts = (2, 3, 4, 8, 16, 31, 32, 33, 48, 64, 100, 256, 600)  # a call of 1 row is padded to 2 (Linear)
    gen = torch.Generator().manual_seed(0)
    for n, k in ((vocab, hidden), (2 * inner, hidden), (hidden, inner), (hidden * 2, hidden)):
        packed = torch.ops.mkldnn._reorder_linear_weight((torch.randn(min(n, 8192), k, generator=gen) * 0.1).bfloat16())

        def product(x, p=packed):
            return torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

        with torch.inference_mode():
            if _floor(_classes(product, k, counts, torch.bfloat16, gen)) != counts[0]:
                return False
    return True


def skip_unless_invariant(vocab: int) -> None:
    if not torch.backends.mkldnn.is_available() or not bf16_product_rows_invariant(vocab):
        pytest.skip("this CPU's bfloat16 product gives a row other bits at other row counts: no same-bits "
                    "promise in bfloat16 here (docs/performance.md)")


def engine_pairs(tokenizer, models, label: str):
    """kind -> (the float32 model for the reference, an engine with the prefix cache, one without), the
    three models from `models(kind)` (a bfloat16 runner packs its weights and frees the model's: one
    model each), made at the first use of a kind; skips where the bfloat16 product is not row-invariant."""
    skip_unless_invariant(len(tokenizer))
    made = {}

    def of(kind):
        if kind not in made:
            reference, cached, uncached = models(kind)
            made[kind] = (reference, Engine(cached, tokenizer, f"{kind}-{label}-cached", []),
                          Engine(uncached, tokenizer, f"{kind}-{label}-uncached", [], prefix_cache_mb=0))
        return made[kind]

    return of


@pytest.fixture(scope="module")
def engines(tokenizer):
    """kind -> (float32 model for the reference, bfloat16 engine with the prefix cache, one without)."""
    vocab = len(tokenizer)
    return engine_pairs(tokenizer, lambda kind: (build(kind, vocab), build(kind, vocab).to(torch.bfloat16),
                                                 build(kind, vocab).to(torch.bfloat16)), "bf16")


@pytest.fixture
def bf16_tolerance(monkeypatch):
    monkeypatch.setattr(float32_tests, "TOL", BF16_TOL)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_a_bf16_generation_has_the_same_bits_beside_any_decoding(kind, engines, reference_of, bf16_tolerance):
    float32_tests.test_a_generation_has_the_same_bits_beside_any_decoding(kind, engines, reference_of)


@pytest.mark.parametrize("kind", ["llama"])
def test_a_bf16_prompts_numbers_have_the_same_bits_beside_anything(kind, engines, reference_of, bf16_tolerance,
                                                                   monkeypatch):
    float32_tests.test_a_prompts_numbers_have_the_same_bits_beside_anything(kind, engines, reference_of, monkeypatch)


def test_smollm2_in_bf16_has_the_same_bits_beside_any_decoding(smol_dir, tokenizer):
    """The bundled model in bfloat16, on 2 threads as a server on 2 vCPUs: a greedy and a seeded sampled
    generation (logprobs 5 and 3) alone, then beside 1 and 16 others; every number bit for bit."""
    smollm2_beside_others(smol_dir, tokenizer, "none")


def smollm2_beside_others(smol_dir, tokenizer, quantization: str) -> None:
    """The bundled model in bfloat16 (with `quantization`) on 2 threads: the probes of
    test_batch_invariance.py alone, then beside 1 and 16 others, compared bit for bit."""
    skip_unless_invariant(len(tokenizer))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model, _ = loader.load(loader.resolve_source(str(smol_dir)), "bfloat16", quantization=quantization)
        engine = Engine(model, tokenizer, f"smollm2-bf16-{quantization}", [], prefix_cache_mb=0)
        assert engine.runner.int4 == (quantization == "int4")
        with torch.inference_mode():
            alone = float32_tests.probes(engine)
            for group in alone:
                float32_tests.drive(engine, [group])
            alone = [float32_tests.answer(g) for g in alone]
            rng = np.random.default_rng(5)
            for count in (1, 16):
                mine = float32_tests.probes(engine)
                float32_tests.drive(engine, float32_tests.others(engine, count, rng), later=mine,
                                    after=int(rng.integers(1, 6)))
                for group, want in zip(mine, alone):
                    float32_tests.assert_same_bits(want, float32_tests.answer(group),
                                                   f"smollm2 bf16 {quantization}: {group.request_id} beside {count}")
    finally:
        torch.set_num_threads(before)
