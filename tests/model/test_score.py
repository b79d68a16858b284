"""/v1/score against a float64 reference, and against /v1/completions with echo + logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest

TOL = 1e-5


def score(client, **body):
    body.setdefault("model", "tiny")
    r = client.post("/v1/score", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_score_matches_reference_with_bos(client, reference, tiny_engine):
    text = "The cat sat on the mat."
    out = score(client, input=text, top_logprobs=3)
    item = out["data"][0]
    bos = tiny_engine.info.bos_token_id
    ids = tiny_engine.tokenizer(text, add_special_tokens=False).input_ids
    assert item["token_ids"] == ids and item["num_tokens"] == len(ids)
    ref = reference.logprobs([bos] + ids).numpy()
    want = [ref[i][ids[i]] for i in range(len(ids))]  # every input token is scored, the first too
    np.testing.assert_allclose(item["token_logprobs"], want, atol=TOL)
    assert abs(item["logprob"] - sum(want)) < 1e-4
    assert abs(item["mean_logprob"] - sum(want) / len(ids)) < 1e-5
    assert math.isclose(item["perplexity"], math.exp(-sum(want) / len(ids)), rel_tol=1e-5)
    assert item["is_greedy"] == all(np.argmax(ref[i]) == ids[i] for i in range(len(ids)))
    assert item["tokens"] == [tiny_engine.table.strings[t] for t in ids]
    for off, tok in zip(item["text_offset"], item["tokens"]):
        assert text[off:off + len(tok)] == tok
    for i, m in enumerate(item["top_logprobs"]):
        assert len(m) in (3, 4) and item["tokens"][i] in m
    assert out["usage"]["prompt_tokens"] == len(ids) + 1


def test_position_stats_match_reference(client, reference, tiny_engine):
    """position_stats: the entropy of the distribution predicting each input token, as the float64
    reference gives it; null for a first token nothing predicts."""
    bos = tiny_engine.info.bos_token_id
    out = score(client, input=["The cat sat on the mat.", "a rug"], context=["", "On the floor:"],
                position_stats=True)
    for item, ctx in zip(out["data"], ["", "On the floor:"]):
        head = [bos] + (tiny_engine.tokenizer(ctx, add_special_tokens=False).input_ids if ctx else [])
        ids = item["token_ids"]
        ref = reference.logprobs(head + ids)[len(head) - 1:-1]  # row j predicts ids[j]
        want = -(ref.exp() * ref).sum(-1).numpy()
        np.testing.assert_allclose(item["position_stats"]["entropy"], want, atol=1e-4)
    plain = score(client, input="The cat sat")["data"][0]
    assert "position_stats" not in plain
    no_bos = score(client, input="The cat sat", add_bos=False, position_stats=True)["data"][0]
    entropy = no_bos["position_stats"]["entropy"]
    assert entropy[0] is None and len(entropy) == len(no_bos["token_ids"]) and all(e > 0 for e in entropy[1:])
    r = client.post("/v1/score", json={"model": "tiny", "input": "a", "position_stats": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "position_stats"


def test_score_equals_completions_echo(client):
    ids = [40, 41, 42, 43, 44]
    s = score(client, input=ids, add_bos=False)["data"][0]
    c = client.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 0, "echo": True,
                                              "logprobs": 0}).json()["choices"][0]["logprobs"]
    assert s["token_logprobs"][0] is None and c["token_logprobs"][0] is None
    assert s["token_logprobs"] == c["token_logprobs"]
    assert s["num_tokens"] == 4


def test_score_and_completions_agree_on_the_same_tokens(client, reference, tiny_engine):
    """docs/api.md section 5's table: a context and an input read by /v1/score (BOS in front) and the same
    text as a completions prompt (no BOS: SmolLM2's tokenizer adds none) differ; `add_bos: false` on the
    score, or the BOS's id in front of a token-id prompt, makes them the same numbers (the reference's)."""
    context, text = "Is the sky blue? Answer:", " no"
    ids = tiny_engine.tokenizer(context + text).input_ids
    bos = tiny_engine.info.bos_token_id
    assert ids[0] != bos  # the tokenizer adds no BOS to a text

    def echoed(prompt):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0}
        return client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["token_logprobs"][-1]

    with_bos = score(client, input=text, context=context)["data"][0]["logprob"]
    without = score(client, input=text, context=context, add_bos=False)["data"][0]["logprob"]
    ref_with, ref_without = (reference.logprobs(head + ids).numpy()[-2][ids[-1]] for head in ([bos], []))
    assert with_bos == pytest.approx(ref_with, abs=TOL) and without == pytest.approx(ref_without, abs=TOL)
    assert abs(with_bos - without) > 100 * TOL  # the BOS changes the number
    assert echoed(context + text) == pytest.approx(without, abs=TOL)
    assert echoed([bos] + ids) == pytest.approx(with_bos, abs=TOL)


def test_context_is_conditioned_on_not_scored(client, reference, tiny_engine):
    out = score(client, input=[" mat", " rug"], context="The cat sat on the")
    bos = tiny_engine.info.bos_token_id
    ctx = tiny_engine.tokenizer("The cat sat on the", add_special_tokens=False).input_ids
    for item, word in zip(out["data"], [" mat", " rug"]):
        ids = tiny_engine.tokenizer(word, add_special_tokens=False).input_ids
        full = [bos] + ctx + ids
        ref = reference.logprobs(full).numpy()
        want = [ref[len(full) - len(ids) - 1 + i][ids[i]] for i in range(len(ids))]
        np.testing.assert_allclose(item["token_logprobs"], want, atol=TOL)
        assert item["tokens"] == [tiny_engine.table.strings[t] for t in ids]


def test_score_errors(client):
    def err(body):
        r = client.post("/v1/score", json={"model": "tiny", **body})
        assert r.status_code == 400, r.text
        return r.json()["error"]

    assert err({})["param"] == "input"
    assert err({"input": 5})["param"] == "input"
    assert err({"input": ["a", "b"], "context": ["x"]})["param"] == "context"
    assert err({"input": "a", "top_logprobs": 101})["param"] == "top_logprobs"
    assert err({"input": [1, 99999999]})["param"] == "input"
    assert err({"input": "a", "echo": True})["param"] == "echo"
    assert err({"input": [5] * 300})["code"] == "context_length_exceeded"
    message = err({"input": [5] * 300, "context": "a b"})["message"]  # scoring has no max_tokens to reduce
    assert message == ("This model's maximum context length is 256 tokens. However, this input is 303 tokens long "
                       "(with its context and the BOS in front, if any). Please shorten the input or its context.")


@pytest.mark.parametrize("n", [1, 7])
def test_many_inputs(client, n):
    out = score(client, input=[f"text number {i}" for i in range(n)])
    assert [d["index"] for d in out["data"]] == list(range(n))


def test_many_inputs_share_one_forward_pass_and_stay_exact(client, reference, tiny_engine):
    texts = ["a", "two words", "a somewhat longer text with more tokens in it", "x y z", "The end.", "!"]
    before = tiny_engine.num_steps
    out = score(client, input=texts)
    assert tiny_engine.num_steps - before == 1  # one padded batch, not six passes
    bos = tiny_engine.info.bos_token_id
    for item, text in zip(out["data"], texts):
        ids = tiny_engine.tokenizer(text, add_special_tokens=False).input_ids
        ref = reference.logprobs([bos] + ids).numpy()
        np.testing.assert_allclose(item["token_logprobs"], [ref[i][ids[i]] for i in range(len(ids))], atol=TOL)
