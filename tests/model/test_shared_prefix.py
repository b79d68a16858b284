"""Prompt-only prompts that begin with the same tokens (a context and its continuations, as in a
multiple-choice question) share that prefix's pass (lean.prompt_batch.PromptBatches.run_shared): their columns must be
what each prompt's own pass gives, and the float64 reference's, with sliding windows crossed inside the
prefix and after it, beside prompts that share nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from logprobe.engine.runners.lean.attention import Attention

from logprobe.engine.engine import Engine
from logprobe.engine.runners.lean import shared_prefixes
from logprobe.engine.host.request import SamplingParams, SequenceGroup
from test_families import build

TOL = 1e-5


def test_prefixes_are_found_in_any_order():
    ctx = list(range(100, 120))
    prompts = [ctx + [1, 2], [7] * 30, ctx + [3], ctx[:10] + [9] * 10, ctx + [1, 5, 6], ctx]
    # each member keeps a token of its own: the context alone (index 5) caps the prefix at 19
    (length, members), = shared_prefixes(prompts, 16)
    assert length == 19 and sorted(members) == [0, 2, 4, 5]
    assert shared_prefixes([ctx + [1], ctx + [2]], 21) == []  # shorter than the minimum
    assert shared_prefixes([ctx + [1]], 4) == []  # one prompt shares with nobody


def columns(engine, prompts, params):
    groups = [SequenceGroup(f"s{i}", ids, SamplingParams(**params), engine.table) for i, ids in enumerate(prompts)]
    with torch.inference_mode():
        engine.runner.prefill_batch(groups)
    return [engine.runner.prompt_columns(g) for g in groups]


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_shared_prefix_columns_equal_their_own_pass_and_the_reference(kind, tokenizer, reference_of):
    model = build(kind, len(tokenizer))
    engine = Engine(model, tokenizer, "m", [])
    ctx = tokenizer("Question: which of these animals lives in the sea and breathes air? Answer:").input_ids
    assert len(ctx) >= 16
    prompts = [ctx + tokenizer(f" {a}", add_special_tokens=False).input_ids
               for a in ("the dolphin", "a cow", "the small brown horse that runs", "fish")]
    prompts += [tokenizer("Something else entirely, with no context in common at all").input_ids]
    ran = []
    shared = engine.runner.prompt_batches.run_shared
    engine.runner.prompt_batches.run_shared = lambda groups, clusters, *head: ran.append(clusters) or shared(groups, clusters, *head)
    for params in (dict(max_tokens=0, prompt_logprobs=3, echo=True), dict(max_tokens=0, prompt_logprobs=-1),
                   dict(max_tokens=0, prompt_logprobs=2, logprob_token_ids=[5, 9, 100], position_stats=True)):
        together = columns(engine, prompts, params)
        assert ran and ran[-1][0][0] == len(ctx) and sorted(ran[-1][0][1]) == [0, 1, 2, 3]
        engine.runner.prompt_batches.SHARED_PREFIX_MIN = 10**9  # each prompt its own pass
        alone = columns(engine, prompts, params)
        del engine.runner.prompt_batches.SHARED_PREFIX_MIN
        reference = reference_of(model)
        for ids, a, b in zip(prompts, together, alone):
            if Attention.invariant_kernels():  # the same bits, whichever pass ran the prefix (torch >= 2.13)
                for name in ("logprobs", "ranks", "top_ids", "top_logprobs", "full", "full_ranks"):
                    x, y = getattr(a, name), getattr(b, name)
                    assert (x is None and y is None) or np.array_equal(x, y, equal_nan=True), name
                if a.extras is not None:
                    for name, x in vars(a.extras).items():
                        if isinstance(x, np.ndarray):
                            assert np.array_equal(x, getattr(b.extras, name), equal_nan=True), name
            assert np.allclose(a.logprobs[1:], b.logprobs[1:], atol=TOL)
            assert np.array_equal(a.ranks[1:], b.ranks[1:]) or np.abs(a.ranks - b.ranks).max() <= 1
            ref = reference.logprobs(ids).numpy()
            want = ref[np.arange(len(ids) - 1), ids[1:]]
            assert np.abs(a.logprobs[1:] - want).max() < TOL
            if a.full is not None:
                assert np.abs(a.full[1:] - ref[:-1]).max() < TOL
            else:
                assert np.allclose(a.top_logprobs[1:], b.top_logprobs[1:], atol=TOL)
            if a.extras is not None:  # rows copied from the prefix's first prompt, and the prompt's own
                assert np.allclose(a.extras.token_id_logprobs[1:], b.extras.token_id_logprobs[1:], atol=TOL)
                assert np.allclose(a.extras.token_id_logprobs[1:], ref[:-1][:, [5, 9, 100]], atol=TOL)
                assert np.allclose(a.extras.entropy[1:], b.extras.entropy[1:], atol=TOL)
