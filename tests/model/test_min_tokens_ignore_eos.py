"""`min_tokens` and `ignore_eos` on the engine, on both runners, against a float64 forward of the same
weights, with a model made to love its end: its stop token is the token it likes best after the prompt.

- `min_tokens`: the stop tokens are masked for the first `min_tokens` tokens (greedy takes the likeliest
  other token); the reported `logprobs` stay the model's raw numbers (the stop token's real probability
  is what was masked), `processed` is the masked distribution the token was drawn from, and
  `constraint_logprobs` the raw mass the mask kept; a stop string counts only from the token after them.
- `ignore_eos`: the stop token is generated as any other and the choice runs to `max_tokens`; stop
  strings still end it.
As vLLM (its MinTokensLogitsProcessor, its detokenizer's stop strings after `min_tokens`, `check_stop`)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from logprobe.engine.host.request import SamplingParams, SequenceGroup

TOL = 2e-5
PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def runner_model(tiny_model):
    """The model `engine` (tests/conftest.py) runs on both runners."""
    return tiny_model


def run(engine, **params):
    ids = engine.tokenizer(PROMPT).input_ids
    group = SequenceGroup("t", ids, SamplingParams(**params), engine.table)
    asyncio.run(engine.run_groups([group]))
    if group.error is not None:
        raise group.error
    return group.output().choices


def rows_along(reference, engine, token_ids) -> np.ndarray:
    """Float64 rows of the distributions each generated token was drawn from."""
    ids = engine.tokenizer(PROMPT).input_ids
    return reference.logprobs(list(ids) + [int(t) for t in token_ids]).numpy()[len(ids) - 1:]


def logsumexp(values: np.ndarray) -> float:
    top = values.max()
    return float(top + np.log(np.exp(values - top).sum()))


@pytest.fixture(scope="module")
def loved(engine, reference) -> int:
    """The token the model likes best after the prompt: made its stop token, the model loves its end."""
    return int(np.argmax(rows_along(reference, engine, [])[0]))


def test_the_model_loves_its_end(engine, loved):
    choice, = run(engine, max_tokens=6, temperature=0, stop_token_ids=frozenset({loved}))
    assert choice.token_ids.tolist() == [loved] and choice.finish_reason == "stop"


@pytest.mark.parametrize("min_tokens", [1, 3, 6])
def test_min_tokens_greedy(engine, reference, loved, min_tokens):
    choice, = run(engine, max_tokens=6, min_tokens=min_tokens, temperature=0, logprobs=2, logprobs_mode="both",
                  stop_token_ids=frozenset({loved}))
    tokens = choice.token_ids.tolist()
    rows = rows_along(reference, engine, tokens)
    assert loved not in tokens[:min_tokens] and len(tokens) >= min_tokens
    for i, token in enumerate(tokens):
        masked = rows[i].copy()
        if i < min_tokens:
            masked[loved] = -np.inf
        assert masked[token] >= masked.max() - TOL  # greedy over what the mask left
        assert choice.logprobs[i] == pytest.approx(rows[i][token], abs=TOL)  # raw: the model's own numbers
        if i == 0:
            assert choice.top_ids[0][0] == loved  # the raw top-k still lists the masked token first
        assert choice.processed_logprobs[i] == 0.0  # greedy: a point mass on the token
        kept = logsumexp(masked[np.isfinite(masked)]) if i < min_tokens else 0.0
        assert choice.constraint_logprobs[i] == pytest.approx(kept, abs=TOL)
    if tokens[-1] == loved:
        assert choice.finish_reason == "stop" and len(tokens) > min_tokens
    else:
        assert choice.finish_reason == "length" and len(tokens) == 6


def test_min_tokens_sampled_reports_the_distribution_sampled(engine, reference, loved):
    """At temperature 1 the processed log probability is the masked, renormalised row where the stop
    token was masked, the raw row after; the raw numbers are the model's throughout."""
    for seed in range(4):
        choice, = run(engine, max_tokens=4, min_tokens=2, temperature=1.0, seed=seed, logprobs=0,
                      logprobs_mode="both", stop_token_ids=frozenset({loved}))
        tokens = choice.token_ids.tolist()
        rows = rows_along(reference, engine, tokens)
        for i, token in enumerate(tokens):
            kept = logsumexp(np.delete(rows[i], loved)) if i < 2 else 0.0
            assert choice.logprobs[i] == pytest.approx(rows[i][token], abs=TOL)
            assert choice.processed_logprobs[i] == pytest.approx(rows[i][token] - kept, abs=TOL)
            assert choice.constraint_logprobs[i] == pytest.approx(kept, abs=TOL)
        assert loved not in tokens[:2]


def test_ignore_eos_runs_past_the_stop_token(engine, reference, loved):
    choice, = run(engine, max_tokens=5, ignore_eos=True, temperature=0, logprobs=1,
                  stop_token_ids=frozenset({loved}))
    tokens = choice.token_ids.tolist()
    assert tokens[0] == loved and len(tokens) == 5 and choice.finish_reason == "length"
    rows = rows_along(reference, engine, tokens)
    for i, token in enumerate(tokens):
        assert rows[i][token] >= rows[i].max() - TOL
        assert choice.logprobs[i] == pytest.approx(rows[i][token], abs=TOL)
    assert choice.constraint_logprobs is None  # nothing masked


def test_ignore_eos_keeps_stop_strings(engine, loved):
    full, = run(engine, max_tokens=5, ignore_eos=True, temperature=0, stop_token_ids=frozenset({loved}))
    third = full.text[full.offsets[2]:full.offsets[3]]
    assert third.strip()
    cut, = run(engine, max_tokens=5, ignore_eos=True, temperature=0, stop=[third], stop_token_ids=frozenset({loved}))
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.find(third)]


@pytest.mark.parametrize("min_tokens", [0, 2, 4])
def test_stop_strings_count_after_min_tokens(engine, min_tokens):
    """A stop string is looked for in the text that ends after the first `min_tokens` tokens (vLLM's
    detokenizer): one found earlier does not end the choice."""
    params = dict(max_tokens=6, min_tokens=min_tokens, temperature=0)
    full, = run(engine, **params)
    stop = full.text[full.offsets[0]:full.offsets[1]]  # the first token's text
    assert stop.strip()
    boundary = full.offsets[min_tokens] if min_tokens < len(full.offsets) else len(full.text)
    hits = [p for p in range(len(full.text)) if full.text.startswith(stop, p) and p + len(stop) > boundary]
    cut, = run(engine, **params, stop=[stop])
    if hits:
        assert cut.finish_reason == "stop" and cut.text == full.text[:hits[0]]
    else:
        assert cut.finish_reason == "length" and cut.text == full.text
