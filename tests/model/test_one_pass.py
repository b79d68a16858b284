"""One pass per step on the lean runner: the decode rows and the prompts' chunks of a step run packed in
one pass of the blocks and one of the head (`LeanRunner.decode_with_prefill`), each decode row attending
over its slab of the KV cache, each chunk over its own prompt. Tiny random-weight float32 models (Llama;
Gemma 3 and Mistral with a sliding window of 12 shorter than the prompts), driven a step at a time:
every step with both kinds of work runs one pass, and every number (generated tokens' log probabilities
and top-k, prompt columns) is the float64 reference's, with interventions on one request, several
choices, and prompts chunked across steps."""

from __future__ import annotations

import numpy as np
import pytest

from logprobe.backend import Intervention
from logprobe.engine.engine import Engine
from logprobe.engine.host.request import SamplingParams, SequenceGroup
from test_families import build
from test_prefix_cache import check_reference
from test_prefix_cache_requests import against_reference, prompt

TOL = 1e-5


@pytest.mark.parametrize("kind", ["llama", "gemma3", "mistral"])
def test_decode_rows_and_prompt_chunks_share_one_pass(kind, tokenizer, reference_of, monkeypatch):
    model = build(kind, len(tokenizer))
    reference = reference_of(model)
    engine = Engine(model, tokenizer, f"{kind}-one-pass", [], prefix_cache_mb=0)
    engine.scheduler.prefill_chunk_tokens = 16  # prompts beside decoding rows go in chunks of 16
    runner = engine.runner
    passes = []
    forward = runner._embed  # every pass of the blocks begins here (`forward`, `forward_steps`)

    def counted(ids, meta, *args, **kwargs):
        passes.append(ids.shape[1])
        return forward(ids, meta, *args, **kwargs)

    monkeypatch.setattr(runner, "_embed", counted)
    made = {
        "a": (prompt(9, salt=40), dict(max_tokens=14, logprobs=3, temperature=0)),
        "b": (prompt(37, salt=41), dict(max_tokens=5, logprobs=2, temperature=0, prompt_logprobs=2, n=2)),
        "c": (prompt(21, salt=42), dict(max_tokens=4, logprobs=2, temperature=0, interventions=(
            Intervention(layer=1, op="add", vector=np.full(64, 0.05, dtype=np.float32)),))),
    }
    groups = {name: SequenceGroup(name, ids, SamplingParams(**params), engine.table)
              for name, (ids, params) in made.items()}
    scheduler = engine.scheduler
    scheduler.add(groups["a"])
    merged = 0
    step = 0
    while scheduler.has_work:
        if step == 2:
            scheduler.add(groups["b"])
        if step == 4:
            scheduler.add(groups["c"])
        plan = scheduler.schedule()
        passes.clear()
        engine.step(plan)
        assert runner.is_consistent(scheduler.running)
        if plan.decode and plan.prefill:
            assert len(passes) == 1  # one pass for both
            merged += 1
        step += 1
    assert merged >= 3  # b's three chunks of 16, 16 and 5 beside a's rows, and c's prompt
    assert all(g.error is None and g.is_finished for g in groups.values()) and not runner.records
    against_reference(reference, made["a"][0], groups["a"])
    against_reference(reference, made["b"][0], groups["b"])
    check_reference(reference, made["b"][0], groups["b"].prompt_columns)
    # c under its intervention: the same numbers as alone (its own pass, no other request beside it)
    alone = SequenceGroup("c", made["c"][0], SamplingParams(**made["c"][1]), engine.table)
    scheduler.add(alone)
    while scheduler.has_work:
        engine.step(scheduler.schedule())
    for x, y in zip(alone.sequences, groups["c"].sequences, strict=True):
        assert x.token_ids == y.token_ids and np.abs(np.asarray(x.logprobs) - y.logprobs).max() < TOL


def test_the_transformers_runner_runs_them_apart(tiny_model, tokenizer):
    engine = Engine(tiny_model, tokenizer, "tiny-hf", [], fast=False)
    assert engine.runner.decode_with_prefill([], []) is None
