"""POST /v1/compare on two engines of one tokenizer (tiny random-weight models, different seeds): every
number against a float64 forward of each model's weights, compared with float64 sums written out here."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from logprobe.api.app import attach_backends, create_app
from logprobe.config import Limits
from logprobe.engine.engine import Engine

RTOL = 1e-5  # float32 engines against float64 references
TOL = 1e-5  # absolute, for log probabilities (as the other reference tests)


@pytest.fixture(scope="module")
def compared(tiny_model, tiny_model_factory, tokenizer, reference_of):
    other = tiny_model_factory(len(tokenizer), seed=2)
    p_engine = Engine(tiny_model, tokenizer, "lab/p", ["p"])
    q_engine = Engine(other, tokenizer, "lab/q", ["q"])
    p_engine.start()
    q_engine.start()
    app = create_app(None, Limits())
    attach_backends(app, [p_engine, q_engine])
    with TestClient(app) as client:
        yield client, reference_of(tiny_model), reference_of(other)
    p_engine.stop()
    q_engine.stop()


def reference_numbers(ref_p, ref_q, ids: list[int], first: int) -> dict:
    """Position i (first..P-1, i >= 1) from the float64 rows that predict token i."""
    rows_p, rows_q = ref_p.logprobs(ids).numpy(), ref_q.logprobs(ids).numpy()
    out = {k: [] for k in ("kl_pq", "kl_qp", "js", "top1", "logprobs", "near_tie")}
    for i in range(max(first, 1), len(ids)):
        lp, lq = rows_p[i - 1], rows_q[i - 1]
        p, q = np.exp(lp), np.exp(lq)
        lm = np.log((p + q) / 2)
        out["kl_pq"].append(np.sum(p * (lp - lq)))
        out["kl_qp"].append(np.sum(q * (lq - lp)))
        out["js"].append(0.5 * np.sum(p * (lp - lm)) + 0.5 * np.sum(q * (lq - lm)))
        out["top1"].append([int(np.argmax(lp)), int(np.argmax(lq))])
        out["logprobs"].append([lp[ids[i]], lq[ids[i]]])
        second = [np.sort(row)[-2] for row in (lp, lq)]
        out["near_tie"].append([row.max() - s < 1e-4 for row, s in zip((lp, lq), second)])
    return out


@pytest.mark.parametrize("body,first", [
    ({"input": "The quick brown fox jumps over the lazy dog"}, 0),
    ({"context": "Once upon a time,", "input": " there was a cat"}, None),
])
def test_every_number_against_float64(compared, tokenizer, body, first):
    client, ref_p, ref_q = compared
    r = client.post("/v1/compare", json={"models": ["p", "q"], **body})
    assert r.status_code == 200, r.text
    out = r.json()
    head = tokenizer(body["context"]).input_ids if "context" in body else []
    tail = tokenizer(body["input"], add_special_tokens=not head).input_ids
    ids = head + tail
    first = len(head) if first is None else first
    assert out["token_ids"] == tail and out["models"] == ["lab/p", "lab/q"]
    want = reference_numbers(ref_p, ref_q, ids, first)
    pos = out["positions"]
    lead = 1 if first == 0 else 0
    assert all(pos[name][0] is None for name in pos) == (lead == 1)
    for name in ("kl_pq", "kl_qp", "js"):
        np.testing.assert_allclose(pos[name][lead:], want[name], rtol=RTOL, err_msg=name)
    np.testing.assert_allclose(pos["logprobs"][lead:], want["logprobs"], atol=TOL)
    for got, exp, tie in zip(pos["top1"][lead:], want["top1"], want["near_tie"]):
        for g, e, t in zip(got, exp, tie):
            assert g == e or t  # within 1e-4 of the top, float32 may order two tokens either way
    agree = [a == b for a, b in pos["top1"][lead:]]
    assert pos["top1_agree"][lead:] == agree
    summary = out["summary"]
    assert summary["num_positions"] == len(want["js"]) == len(tail) - lead
    for name in ("kl_pq", "kl_qp", "js"):
        np.testing.assert_allclose(summary["mean_" + name], np.mean(want[name]), rtol=RTOL, err_msg=name)
    assert summary["top1_agreement"] == pytest.approx(np.mean(agree))
    np.testing.assert_allclose(summary["sum_logprob"], np.sum(want["logprobs"], axis=0), atol=TOL * len(ids))
    # the two models really differ, and q's log probabilities of the actual tokens are /v1/score's
    assert min(pos["kl_pq"][lead:]) > 1e-2
    score = client.post("/v1/score", json={"model": "q", "add_bos": False, **body}).json()["data"][0]
    assert score["token_ids"] == tail
    np.testing.assert_allclose([lp[1] for lp in pos["logprobs"][lead:]], score["token_logprobs"][lead:], atol=TOL)
