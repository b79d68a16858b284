"""Continuous batching: requests that run together give what they give alone, and both runners (the
batched lean runner and transformers' forward) agree with the float64 reference."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from logprobe.engine.engine import Engine
from logprobe.engine.host.request import SamplingParams, SequenceGroup
from logprobe.engine.runners.lean.attention import Attention

TOL = 1e-5


def run(engine, groups):
    asyncio.run(engine.run_groups(groups))
    return groups


@pytest.fixture(scope="module")
def hf_engine(tiny_model, tokenizer):
    engine = Engine(tiny_model, tokenizer, "hf", [], fast=False)
    engine.start()
    yield engine
    engine.stop()


def make(engine, prompt, **params):
    ids = engine.tokenizer(prompt).input_ids if isinstance(prompt, str) else prompt
    return SequenceGroup("t", ids, SamplingParams(**params), engine.table)


@pytest.mark.parametrize("which", ["fast", "hf"])
def test_runner_matches_reference(which, tiny_engine, hf_engine, reference):
    engine = tiny_engine if which == "fast" else hf_engine
    assert type(engine.runner).__name__ == ("LeanRunner" if which == "fast" else "ModelRunner")
    groups = [make(engine, p, max_tokens=8, n=n, seed=s, logprobs=3, echo=True)
              for p, n, s in [("Once upon a time", 2, 1), ("x", 1, 2), ("a much longer prompt than the others", 3, 3)]]
    run(engine, groups)
    for g in groups:
        cols = g.prompt_columns
        ref_prompt = reference.logprobs(g.prompt_ids).numpy()
        np.testing.assert_allclose(cols.logprobs[1:], [ref_prompt[i - 1][g.prompt_ids[i]] for i in range(1, len(g.prompt_ids))],
                                   atol=TOL)
        for s in g.sequences:
            ref = reference.logprobs(g.prompt_ids + s.token_ids).numpy()
            want = [ref[len(g.prompt_ids) - 1 + i][t] for i, t in enumerate(s.token_ids)]
            np.testing.assert_allclose(s.logprobs, want, atol=TOL)
            top = np.stack(s.top_logprobs)
            want_top = np.sort(ref[len(g.prompt_ids) - 1:-1], axis=1)[:, ::-1][:len(s.token_ids), :3]
            np.testing.assert_allclose(top, want_top, atol=TOL)


def test_decode_steps_are_shared(tiny_engine):
    before = tiny_engine.num_steps
    groups = [make(tiny_engine, f"prompt {i}", max_tokens=10, temperature=0) for i in range(6)]
    run(tiny_engine, groups)
    # alone: 6 x 10 steps; batched: the prefills (one per step, beside the others' decoding) and
    # about 10 shared decode steps
    assert tiny_engine.num_steps - before <= 6 + 10 + 1


def test_long_prompt_is_chunked_beside_decoding(tiny_engine, monkeypatch):
    monkeypatch.setattr(tiny_engine.scheduler, "prefill_chunk_tokens", 16)
    short = make(tiny_engine, [5, 6, 7], max_tokens=200, temperature=0)
    long = make(tiny_engine, list(range(100, 200)), max_tokens=2, temperature=0, echo=True, logprobs=0)
    seen = []
    short.on_step = lambda g: seen.append(("short", len(g.sequences[0].token_ids)))
    long.on_step = lambda g: seen.append(("long", len(g.sequences[0].token_ids)))

    async def both():
        fut = tiny_engine.submit([short])
        while len(seen) < 2:  # the short request is decoding (198 tokens to go)
            await asyncio.sleep(0.001)
        await asyncio.gather(*fut, *tiny_engine.submit([long]))

    asyncio.run(both())
    # the short request kept decoding while the 100-token prompt went through in 16-token chunks
    first_long = next(i for i, s in enumerate(seen) if s[0] == "long")
    assert any(s[0] == "short" for s in seen[first_long:])
    assert short.sequences[0].finish_reason.value == "length"


def test_mixed_concurrent_requests_equal_alone(client):
    """32 concurrent mixed requests (generation with logprobs, echo scoring, prompt_logprobs, n > 1),
    each checked against the same request run alone: the same answer, to the bit from torch 2.13 on."""
    bodies = []
    for i in range(32):
        kind = i % 4
        body = {"model": "tiny", "prompt": f"request number {i} " * (1 + i % 5), "seed": i}
        if kind == 0:
            body.update(max_tokens=12, logprobs=3, temperature=0.9)
        elif kind == 1:
            body.update(max_tokens=0, echo=True, logprobs=2)
        elif kind == 2:
            body.update(max_tokens=4, prompt_logprobs=3)
        else:
            body.update(max_tokens=8, n=3, logprobs=1, temperature=1.0)
        bodies.append(body)
    alone = [client.post("/v1/completions", json=b).json() for b in bodies]
    together = [None] * len(bodies)

    def worker(i):
        together[i] = client.post("/v1/completions", json=bodies[i]).json()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(alone, together):
        if Attention.invariant_kernels():  # torch >= 2.13: every number the same bits (the JSON the same)
            assert a["choices"] == b["choices"]
        for ca, cb in zip(a["choices"], b["choices"]):
            assert ca["text"] == cb["text"]
            if ca["logprobs"]:
                assert ca["logprobs"]["tokens"] == cb["logprobs"]["tokens"]
                x = [v for v in ca["logprobs"]["token_logprobs"] if v is not None]
                y = [v for v in cb["logprobs"]["token_logprobs"] if v is not None]
                np.testing.assert_allclose(x, y, atol=TOL)
            if ca["prompt_logprobs"]:
                for pa, pb in zip(ca["prompt_logprobs"][1:], cb["prompt_logprobs"][1:]):
                    assert pa.keys() == pb.keys()
                    np.testing.assert_allclose([v["logprob"] for v in pa.values()],
                                               [v["logprob"] for v in pb.values()], atol=TOL)


def test_short_prompts_share_one_prefill_pass(tiny_engine, reference, monkeypatch):
    """Prompts that arrive together are prefilled in one packed forward pass (block-diagonal mask), with
    the same numbers as the float64 reference, including a prompt long enough to be chunked."""
    sizes = []
    real = tiny_engine.runner.prefill_chunks

    def spy(chunks):
        sizes.append(len(chunks))
        return real(chunks)

    monkeypatch.setattr(tiny_engine.runner, "prefill_chunks", spy)
    prompts = [[5 + i] * (3 + i) for i in range(6)]
    groups = [make(tiny_engine, p, max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=2) for p in prompts]
    run(tiny_engine, groups)
    assert max(sizes) >= 2
    for g in groups:
        ref = reference.logprobs(g.prompt_ids + g.sequences[0].token_ids).numpy()
        p = len(g.prompt_ids)
        np.testing.assert_allclose(g.prompt_columns.logprobs[1:], [ref[i - 1][g.prompt_ids[i]] for i in range(1, p)],
                                   atol=TOL)
        want = [ref[p - 1 + i][t] for i, t in enumerate(g.sequences[0].token_ids)]
        np.testing.assert_allclose(g.sequences[0].logprobs, want, atol=TOL)
        assert g.sequences[0].token_ids[0] == int(np.argmax(ref[p - 1]))


def test_kv_cache_shrinks_when_idle(tiny_engine):
    """The slot cache grows with the batch; once the engine is idle it goes back to its first size."""
    cache, kv = tiny_engine.runner.cache, tiny_engine.kv
    slots, capacity = kv._initial
    initial = [(capacity, slots)]  # (capacity, slots) of each size class

    def classes():  # the memory's (which follows the manager's)
        return [(c, slab.num_slots) for c, slab in cache.slabs.items()]

    groups = [make(tiny_engine, [5 + i, 6], max_tokens=20, n=3, temperature=1.0, seed=i) for i in range(8)]
    during = []  # the classes after each step (read after the run, the engine may already have shrunk them)
    tiny_engine.step_observer = lambda seconds, rows: during.append(dict(classes()))
    try:
        run(tiny_engine, groups)
    finally:
        tiny_engine.step_observer = None
    assert any(c.get(capacity, 0) >= 24 or len(c) > 1 for c in during)
    deadline = time.time() + 120
    while classes() != initial and time.time() < deadline:
        time.sleep(0.05)
    # float32, over the positions the class holds (its capacity, or more: Attention.held)
    bytes_per_slot = 2 * cache.num_layers * cache.kv_heads * cache.positions(capacity) * cache.head_dim * 4
    assert classes() == initial and not kv.rows and cache.nbytes == slots * bytes_per_slot
    assert cache.matches(kv)
