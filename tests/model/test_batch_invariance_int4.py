"""`--dtype bfloat16 --quantization int4` gives a request the same bits beside anything, on a CPU whose
packed bfloat16 product gives a row the same bits in calls of 2 rows or more (as test_batch_invariance_bf16.py,
whose probe decides the skip). Every decode row reads the 4-bit weights, whatever the step's row count:
PyTorch's int4 kernel gives a row the same bits in calls of any count (the first test here probes it);
every prompt row reads the dense bfloat16 weights, also where a prompt's chunk shares a pass with decode
rows (`PassMeta.int4_rows`). A generation's keys computed by decode steps are not kept as a later
prompt's prefix: that prompt, run without the cache, computes them with the dense weights.

The tests of test_batch_invariance.py on tiny Llama and Gemma 3 models whose projections lie on a Q4_1
grid (a generation beside 1, 5 and 16 decoding others; Llama: a scored text and a generation's prompt
beside 1, 7, 24 and 63 requests of every kind, with and without the prefix cache), a client's loop of a
generation sent back with more text, and SmolLM2 itself (a Q4_1 GGUF) with 2 threads.

Slow: the prompt test runs 190 requests of every kind (about 20 s on 2 vCPUs, so Llama only: Gemma 3 is
in the generation test); SmolLM2's runs 68 generations on the real model (about 10 s)."""

from __future__ import annotations

import pytest
import torch

import test_batch_invariance as float32_tests
from logprobe.engine.host.request import SamplingParams, SequenceGroup
from logprobe.engine.runners import int4
from test_batch_invariance_bf16 import bf16_tolerance, engine_pairs, smollm2_beside_others  # noqa: F401 (a fixture)
from test_fast_paths import on_grid
from test_families import build

pytestmark = pytest.mark.skipif(not int4.available(), reason="no CPU int4 kernel in this torch")


def test_the_int4_kernel_gives_a_row_the_same_bits_in_calls_of_any_row_count():
    """What every decode row reading the 4-bit weights rests on: a probe row's product in calls of 1 to
    600 rows, at any place in the call, on 1 and 2 threads."""
    gen = torch.Generator().manual_seed(2)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for n, k in ((96, 64), (256, 64), (64, 128)):
                q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
                scale = torch.rand(n, k // int4.GROUP, generator=gen) * 0.02
                lin = int4.Int4Linear([int4.Grid(q, scale, -7.5 * scale)])
                x = torch.randn(600, k, generator=gen).to(torch.bfloat16)
                alone = lin(x[:1])
                for count in (2, 3, 5, 8, 9, 16, 33, 64, 100, 600):
                    got = lin(x[:count])
                    assert torch.equal(got[:1], alone), (threads, n, k, count)
                    at = count // 2  # the probe row elsewhere in the call
                    moved = x[:count].clone()
                    moved[at] = x[0]
                    assert torch.equal(lin(moved)[at:at + 1], alone), (threads, n, k, count, at)
    finally:
        torch.set_num_threads(before)


def int4_model(kind: str, vocab: int):
    """(the float32 model on a 4-bit grid, for the float64 reference; its bfloat16 copy with its grids)"""
    model = on_grid(build(kind, vocab))
    grids = int4.decoder_grids(model)
    quantized = on_grid(build(kind, vocab)).to(torch.bfloat16)
    quantized.logprobe_int4 = grids
    return model, quantized


@pytest.fixture(scope="module")
def engines(tokenizer):
    """kind -> (float32 grid model, bfloat16 + int4 engine with the prefix cache, one without)."""
    vocab = len(tokenizer)

    def models(kind):
        reference, cached = int4_model(kind, vocab)
        return reference, cached, int4_model(kind, vocab)[1]

    return engine_pairs(tokenizer, models, "int4")


@pytest.mark.usefixtures("bf16_tolerance")
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_an_int4_generation_has_the_same_bits_beside_any_decoding(kind, engines, reference_of):
    """Alone its decode steps are 1 row; beside 5 or 16 others, up to 18 (the dense weights' side of
    the old threshold of 8 rows)."""
    float32_tests.test_a_generation_has_the_same_bits_beside_any_decoding(kind, engines, reference_of)


@pytest.mark.usefixtures("bf16_tolerance")
@pytest.mark.parametrize("kind", ["llama"])
def test_an_int4_prompts_numbers_have_the_same_bits_beside_anything(kind, engines, reference_of, monkeypatch):
    """Prompt chunks next to decode rows in one pass: the chunks read the dense weights, the rows the 4-bit."""
    float32_tests.test_a_prompts_numbers_have_the_same_bits_beside_anything(kind, engines, reference_of, monkeypatch)


def test_a_prompt_after_an_int4_generation_has_the_bits_it_has_without_the_cache(engines):
    """A client's loop: a generation, then its prompt and generated text sent back with more tokens. The
    prefix cache keeps the first call's prompt, not its generated tokens' keys (the 4-bit weights made
    them): the second call's numbers are those of the engine without a cache."""
    _, cached, uncached = engines("llama")
    assert cached.runner.int4 and uncached.runner.int4
    cached.runner.prefix_cache.clear()
    prompt = float32_tests.prompt
    with torch.inference_mode():
        first = SequenceGroup("first", prompt(40, 8), SamplingParams(max_tokens=30, temperature=0), cached.table)
        float32_tests.drive(cached, [first])
        ids = prompt(40, 8) + list(first.sequences[0].token_ids) + prompt(20, 9)[1:]
        answers, saved = [], cached.runner.prefix_cache.tokens_saved
        for engine in (cached, uncached):
            second = SequenceGroup("second", ids, SamplingParams(max_tokens=8, logprobs=3, temperature=0), engine.table)
            float32_tests.drive(engine, [second])
            answers.append(list(float32_tests.answer(second)[1:]))
        assert cached.runner.prefix_cache.tokens_saved - saved == 40  # the first prompt, none of what it generated
    float32_tests.assert_same_arrays(answers[1], answers[0], "after the kept generation")


def test_smollm2_in_bf16_int4_has_the_same_bits_beside_any_decoding(smol_dir, tokenizer):
    """The bundled model as `--dtype bfloat16 --quantization int4` serves it, on 2 threads as a server on
    2 vCPUs: a greedy and a seeded sampled generation (logprobs 5 and 3) alone, then beside 1 and 16
    others; every number bit for bit."""
    smollm2_beside_others(smol_dir, tokenizer, "int4")
