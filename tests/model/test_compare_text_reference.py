"""POST /v1/compare with `align: "text"` on two tiny random-weight models of different tokenizers
(SmolLM2's byte-level BPE, 49,152 tokens; Gemma 3's SentencePiece with byte fallback, 262,144): every span,
its log probability in each model, bits per byte and the disagreements against float64 forwards of
both models' weights, with the spans found here from each tokenizer's own decoding of its prefixes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from fastapi.testclient import TestClient

from logprobe.api.app import attach_backends, create_app
from logprobe.config import Limits
from logprobe.engine.engine import Engine

TOL = 1e-5  # absolute, per token: float32 engines against float64 references (as the other reference tests)
TEXTS = [
    ("The naïve café owner said: 日本語 is fun 🙂, isn't it?\n\n  Yes.", None),
    (" — and then, 1234 ÷ 7 ≈ 176.29", "Question: what is it?\nAnswer:"),
]


@pytest.fixture(scope="module")
def compared(tiny_model, tokenizer, gemma_tokenizer, tiny_model_factory, reference_of):
    gemma_model = tiny_model_factory(len(gemma_tokenizer), seed=3, bos_token_id=gemma_tokenizer.bos_token_id,
                                     eos_token_id=gemma_tokenizer.eos_token_id)
    engines = [Engine(tiny_model, tokenizer, "lab/smol", ["smol"]),
               Engine(gemma_model, gemma_tokenizer, "lab/gemma", ["gemma"])]
    for engine in engines:
        engine.start()
    app = create_app(None, Limits())
    attach_backends(app, engines)
    with TestClient(app) as client:
        yield client, [(tokenizer, reference_of(tiny_model)), (gemma_tokenizer, reference_of(gemma_model))]
    for engine in engines:
        engine.stop()


def reference_scores(tok, ref, text: str, context: str | None) -> tuple[list[int], np.ndarray]:
    """The input's ids and each one's float64 log probability after [BOS] + context + the ids before it."""
    head = [tok.bos_token_id] + (tok(context, add_special_tokens=False).input_ids if context else [])
    ids = tok(text, add_special_tokens=False).input_ids
    full = head + ids
    rows = ref.logprobs(full).numpy()
    return ids, np.array([rows[i - 1][full[i]] for i in range(len(head), len(full))])


def char_cuts(tok, ids: list[int], text: str) -> dict[int, int]:
    """{character offset: number of tokens before it} for every token boundary of `ids` that falls
    between two characters, found by decoding each prefix (one that ends inside a character decodes to
    a replacement character, or to text that is not a prefix of `text`)."""
    cuts = {}
    for k in range(len(ids) + 1):
        prefix = tok.decode(ids[:k], clean_up_tokenization_spaces=False)
        if text.startswith(prefix) and not prefix.endswith("\ufffd"):
            cuts.setdefault(len(prefix), k)
    return cuts


@pytest.mark.parametrize("text,context", TEXTS)
def test_spans_against_float64(compared, text, context):
    client, models = compared
    body = {"models": ["smol", "gemma"], "input": text, "align": "text"}
    if context:
        body["context"] = context
    r = client.post("/v1/compare", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    scores = [reference_scores(tok, ref, text, context) for tok, ref in models]
    cuts = [char_cuts(tok, ids, text) for (tok, _), (ids, _) in zip(models, scores)]
    edges = sorted(set(cuts[0]) & set(cuts[1]))
    assert edges[0] == 0 and edges[-1] == len(text)
    assert out["spans"]["text_offset"] == edges[:-1]
    assert out["spans"]["text"] == [text[a:b] for a, b in zip(edges[:-1], edges[1:])]
    assert out["spans"]["byte_offset"] == [len(text[:e].encode()) for e in edges[:-1]]
    want = np.zeros((len(edges) - 1, 2))
    for m, ((ids, lps), cut) in enumerate(zip(scores, cuts)):
        assert out["tokenizations"][m]["token_ids"] == ids
        np.testing.assert_allclose(out["tokenizations"][m]["token_logprobs"], lps, atol=TOL)
        for s, (a, b) in enumerate(zip(edges[:-1], edges[1:])):
            want[s, m] = math.fsum(lps[cut[a]:cut[b]])
            assert out["spans"]["num_tokens"][s][m] == cut[b] - cut[a]
        num = len(text.encode())
        assert out["summary"]["bits_per_byte"][m] == pytest.approx(-math.fsum(lps) / math.log(2) / num,
                                                                   abs=TOL * len(ids) / num)
    got = np.array(out["spans"]["logprobs"])
    counts = np.array(out["spans"]["num_tokens"])
    assert np.all(np.abs(got - want) <= TOL * counts)
    np.testing.assert_allclose(np.array(out["spans"]["difference"])[:, 0], want[:, 1] - want[:, 0],
                               atol=TOL * counts.sum(1).max())
    spread = np.abs(want[:, 1] - want[:, 0])
    top = out["disagreements"]
    assert len(top) == min(10, len(edges) - 1)
    # listed by spread, largest first; a span left out has no larger spread than the last one listed
    listed = spread[top]
    assert np.all(np.diff(listed) <= 2 * TOL * counts.sum())
    rest = np.delete(spread, top)
    assert rest.size == 0 or rest.max() <= listed[-1] + 2 * TOL * counts.sum()
    # the tokenizations differ, and several of SmolLM2's tokens share a span (the pieces of 日本語)
    assert scores[0][0] != scores[1][0] and len(edges) - 1 < len(scores[0][0])


def test_the_numbers_are_each_models_score(compared):
    """Each model's span log probabilities add up to its /v1/score `logprob` of the text."""
    client, _ = compared
    text = TEXTS[0][0]
    out = client.post("/v1/compare", json={"models": ["gemma", "smol"], "input": text, "align": "text"}).json()
    for m, name in enumerate(["gemma", "smol"]):
        score = client.post("/v1/score", json={"model": name, "input": text}).json()["data"][0]
        # the score call may start from the compare's tokens in the prefix cache: float32 rounding apart
        np.testing.assert_allclose(out["tokenizations"][m]["token_logprobs"], score["token_logprobs"], atol=TOL)
        assert out["summary"]["logprob"][m] == pytest.approx(score["logprob"], abs=TOL * score["num_tokens"])
