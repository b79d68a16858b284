"""POST /v1/compare on two fake models: the shape of the answer and its numbers (against float64 sums
over the fakes' own rows), one hold for both models' passes, and every refusal before any work."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from fake_backend import FakeBackend, TinyTokenizer
from logprobe.api.app import attach_backends, create_app
from logprobe.config import Limits

TEXT = "The sky is blue today"


def pair_of(tokenizer, **kw):
    a = FakeBackend(tokenizer, name="lab/model-a", aliases=("a",), num_layers=2, d_model=64, context_length=256, **kw)
    b = FakeBackend(tokenizer, name="lab/model-b", aliases=("b",), num_layers=2, d_model=64, context_length=128,
                    salt=0x5A17, **kw)
    return a, b


def app_of(backends, limits: Limits | None = None):
    app = create_app(None, limits or Limits())
    attach_backends(app, list(backends))
    return app


@pytest.fixture
def two(tokenizer):
    return pair_of(tokenizer)


def expected(a, b, ids: list[int], first: int) -> dict:
    """The numbers, straight from the definitions over the fakes' float32 rows, in float64."""
    out = {k: [] for k in ("kl_pq", "kl_qp", "js", "top1", "top1_agree", "logprobs")}
    for i in range(first, len(ids)):
        if i == 0:
            for column in out.values():
                column.append(None)
            continue
        lp = a.logprobs_after(ids[:i]).astype(np.float64)
        lq = b.logprobs_after(ids[:i]).astype(np.float64)
        p, q = np.exp(lp), np.exp(lq)
        m = (p + q) / 2
        out["kl_pq"].append(float(np.sum(p * (lp - lq))))
        out["kl_qp"].append(float(np.sum(q * (lq - lp))))
        out["js"].append(float(0.5 * np.sum(p * np.log(p / m)) + 0.5 * np.sum(q * np.log(q / m))))
        top = [int(np.argmax(lp)), int(np.argmax(lq))]
        out["top1"].append(top)
        out["top1_agree"].append(top[0] == top[1])
        out["logprobs"].append([float(lp[ids[i]]), float(lq[ids[i]])])
    return out


def close(got: list, want: list, rtol: float = 1e-6) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-9)


def test_answer_shape_and_numbers(two, tokenizer):
    a, b = two
    ids = tokenizer(TEXT).input_ids
    with TestClient(app_of(two)) as c:
        r = c.post("/v1/compare", json={"models": ["a", "lab/model-b"], "input": TEXT})
        assert r.status_code == 200, r.text
        out = r.json()
        assert c.get("/health").json()["tokens_held"] == 0
    assert set(out) == {"object", "models", "tokens", "token_ids", "text_offset", "positions", "summary", "usage"}
    assert out["object"] == "comparison" and out["models"] == ["lab/model-a", "lab/model-b"]
    assert out["token_ids"] == ids and out["tokens"] == a.table.strings[ids].tolist()
    assert out["text_offset"][0] == 0 and len(out["text_offset"]) == len(ids)
    assert out["usage"] == {"prompt_tokens": 2 * len(ids), "total_tokens": 2 * len(ids)}
    pos = out["positions"]
    assert set(pos) == {"kl_pq", "kl_qp", "js", "top1", "top1_tokens", "top1_agree", "logprobs"}
    want = expected(a, b, ids, 0)
    for name in ("kl_pq", "kl_qp", "js", "logprobs"):
        close(pos[name], want[name])
    assert pos["top1"] == want["top1"] and pos["top1_agree"] == want["top1_agree"]
    assert pos["top1_tokens"][0] is None
    assert pos["top1_tokens"][1:] == [a.table.strings[t].tolist() for t in want["top1"][1:]]
    assert all(x > 0 for x in pos["kl_pq"][1:]) and all(0 < x < np.log(2) for x in pos["js"][1:])
    summary = out["summary"]
    n = len(ids) - 1
    assert summary["num_positions"] == n
    for name in ("kl_pq", "kl_qp", "js"):
        np.testing.assert_allclose(summary["mean_" + name], np.mean(want[name][1:]), rtol=1e-6)
    assert summary["top1_agreement"] == sum(want["top1_agree"][1:]) / n
    np.testing.assert_allclose(summary["sum_logprob"], np.sum(want["logprobs"][1:], axis=0), rtol=1e-6)
    # each model ran once, the tokens alone, with every position's whole vocabulary
    for backend in (a, b):
        (call,) = backend.calls
        (request,) = call.requests
        assert request.prompt_ids == ids
        assert (request.params.max_tokens, request.params.prompt_logprobs) == (0, -1)


def test_order_swaps_p_and_q(two, tokenizer):
    with TestClient(app_of(two)) as c:
        ab = c.post("/v1/compare", json={"models": ["a", "b"], "input": TEXT}).json()
        ba = c.post("/v1/compare", json={"models": ["b", "a"], "input": TEXT}).json()
    assert ab["positions"]["kl_pq"] == ba["positions"]["kl_qp"]
    assert ab["positions"]["js"] == ba["positions"]["js"]
    assert ab["positions"]["logprobs"][1:] == [[y, x] for x, y in ba["positions"]["logprobs"][1:]]


def test_context_is_run_not_compared(two, tokenizer):
    a, b = two
    context = "Weather report:"
    head = tokenizer(context).input_ids
    body_ids = tokenizer(" sunny", add_special_tokens=False).input_ids
    with TestClient(app_of(two)) as c:
        out = c.post("/v1/compare", json={"models": ["a", "b"], "input": " sunny", "context": context}).json()
    ids = head + body_ids
    assert out["token_ids"] == body_ids and out["usage"]["prompt_tokens"] == 2 * len(ids)
    want = expected(a, b, ids, len(head))
    assert out["positions"]["kl_pq"][0] is not None  # the first input token has the context before it
    for name in ("kl_pq", "kl_qp", "js", "logprobs"):
        close(out["positions"][name], want[name])
    assert out["summary"]["num_positions"] == len(body_ids)
    assert a.calls[0].requests[0].prompt_ids == ids


def test_token_ids_and_token_names(two):
    with TestClient(app_of(two)) as c:
        out = c.post("/v1/compare", json={"models": ["a", "b"], "input": [504, 2644, 2643],
                                          "return_tokens_as_token_ids": True}).json()
        assert out["tokens"] == ["token_id:504", "token_id:2644", "token_id:2643"]
        assert all(isinstance(t, str) and t.startswith("token_id:") for pair in out["positions"]["top1_tokens"][1:]
                   for t in pair)
        one = c.post("/v1/compare", json={"models": ["a", "b"], "input": [504]}).json()
    assert one["positions"]["js"] == [None] and one["summary"]["num_positions"] == 0
    assert one["summary"]["mean_js"] is None and one["summary"]["top1_agreement"] is None
    assert one["summary"]["sum_logprob"] == [0.0, 0.0]


class RulesOut(FakeBackend):
    """A fake whose every distribution gives token 7 probability zero (log probability -inf)."""

    def _row(self, a, b):
        row = super()._row(a, b).astype(np.float64)
        row[7] = -np.inf
        row -= np.log(np.exp(row).sum())
        return row.astype(np.float32)


def test_infinite_divergence_is_written_9999(tokenizer):
    a = FakeBackend(tokenizer, name="lab/model-a", aliases=("a",))
    b = RulesOut(tokenizer, name="lab/model-b", aliases=("b",), salt=0x5A17)
    with TestClient(app_of([a, b])) as c:
        out = c.post("/v1/compare", json={"models": ["a", "b"], "input": [504, 7, 2643]}).json()
    pos = out["positions"]
    assert pos["kl_pq"][1:] == [9999.0, 9999.0]  # p gives token 7 mass, q none
    assert all(0 < x < 100 for x in pos["kl_qp"][1:]) and all(0 < x < np.log(2) for x in pos["js"][1:])
    assert pos["logprobs"][1][1] == -9999.0  # q's log probability of the actual token 7
    assert out["summary"]["mean_kl_pq"] == 9999.0 and out["summary"]["sum_logprob"][1] == -9999.0


def refusal(r, status: int, param: str | None, code: str = "invalid_request") -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error", "request_id"} and body["request_id"] == r.headers["x-request-id"]
    assert (body["error"]["param"], body["error"]["code"]) == (param, code), body
    return body["error"]["message"]


@pytest.mark.parametrize("body,status,param,words", [
    ({"models": ["a"], "input": TEXT}, 400, "models", "expected two model names (two or more with 'align': 'text'), got 1"),
    ({"models": ["a", "b", "a"], "input": TEXT}, 400, "models", "got 3"),
    ({"models": ["a", "lab/model-a"], "input": TEXT}, 400, "models", "'a' and 'lab/model-a' are both the model lab/model-a"),
    ({"models": "a,b", "input": TEXT}, 400, "models", "Invalid type for 'models'"),
    ({"models": ["a", 2], "input": TEXT}, 400, "models", "Invalid type for 'models'"),
    ({"input": TEXT}, 400, "models", "Missing required parameter: 'models'"),
    ({"models": ["a", "nope"], "input": TEXT}, 404, "models", "The model `nope` does not exist"),
    ({"model": "a", "input": TEXT}, 400, "model", "takes 'models'"),
    ({"models": ["a", "b"]}, 400, "input", "Missing required parameter: 'input'"),
    ({"models": ["a", "b"], "input": ""}, 400, "input", "has no tokens"),
    ({"models": ["a", "b"], "input": []}, 400, "input", "non-empty"),
    ({"models": ["a", "b"], "input": ["x", "y"]}, 400, "input", "a string or an array of token ids"),
    ({"models": ["a", "b"], "input": [1, 49152]}, 400, "input", "outside the vocabulary"),
    ({"models": ["a", "b"], "input": TEXT, "context": 5}, 400, "context", "Invalid type for 'context'"),
    ({"models": ["a", "b"], "input": TEXT, "stream": True}, 400, "stream", "does not stream"),
    ({"models": ["a", "b"], "input": TEXT, "top_logprobs": 2}, 400, "top_logprobs", "Unrecognized request argument"),
    ({"models": ["a", "b"], "input": "x " * 200}, 400, "input", "maximum context length is 128"),
])
def test_refusals_before_any_work(two, body, status, param, words):
    a, b = two
    with TestClient(app_of(two), raise_server_exceptions=False) as c:
        message = refusal(c.post("/v1/compare", json=body), status, param,
                          "model_not_found" if status == 404 else
                          "context_length_exceeded" if "context length" in words else "invalid_request")
    assert words in message
    assert a.calls == [] and b.calls == []


def test_stream_false_is_accepted(two):
    with TestClient(app_of(two)) as c:
        assert c.post("/v1/compare", json={"models": ["a", "b"], "input": TEXT, "stream": False}).status_code == 200


class NoBos(TinyTokenizer):
    """TinyTokenizer's vocabulary, but it never adds `<s>`: the same tokens, other ids for a text."""

    def encode(self, text, add_special_tokens=True):
        return super().encode(text, add_special_tokens=False)


def test_tokenizers_that_differ_are_refused(tokenizer):
    smol = FakeBackend(tokenizer, name="lab/smol", aliases=("smol",))
    tiny = FakeBackend(TinyTokenizer(), name="lab/tiny", aliases=("tiny",))
    no_bos = FakeBackend(NoBos(), name="lab/no-bos", aliases=("no-bos",))
    renamed = FakeBackend(TinyTokenizer(), name="lab/renamed", aliases=("renamed",))
    strings = renamed.table.strings.copy()
    strings[65] = "B"  # token 65 is "A" in the others
    renamed.table = dataclasses.replace(renamed.table, strings=strings)
    backends = [smol, tiny, no_bos, renamed]
    with TestClient(app_of(backends), raise_server_exceptions=False) as c:
        def refused(models, input=TEXT):
            return refusal(c.post("/v1/compare", json={"models": models, "input": input}), 400, "models")

        assert "vocabulary sizes 49152 vs 258" in refused(["smol", "tiny"])
        assert "vocabulary sizes 258 vs 49152" in refused(["tiny", "smol"])
        assert "token 65 is 'A' in one and 'B' in the other" in refused(["tiny", "renamed"])
        message = refused(["tiny", "no-bos"])
        assert "tokenize this text differently: token 0 is 256 vs 84" in message
        assert "lab/tiny and lab/no-bos do not share a tokenizer" in message
        # token ids need no tokenizing: the same vocabulary is enough
        assert c.post("/v1/compare", json={"models": ["tiny", "no-bos"], "input": [256, 84, 104]}).status_code == 200
        assert refused(["smol", "tiny"], [1, 2]).startswith("The models lab/smol and lab/tiny")
    assert [len(b.calls) for b in backends] == [0, 1, 1, 0]


def test_whole_vocabulary_cap(two, tokenizer):
    limits = Limits(max_vocab_positions=6)
    with TestClient(app_of(two, limits)) as c:
        card = c.get("/v1/models/a").json()
        assert card["limits"]["vocab_positions"] == 6
        ok = tokenizer("one two three four five six", add_special_tokens=False).input_ids
        assert len(ok) == 6
        assert c.post("/v1/compare", json={"models": ["a", "b"], "input": ok}).status_code == 200
        context = "zero one two three four five"
        num = len(tokenizer(context).input_ids) + len(tokenizer(" one", add_special_tokens=False).input_ids)
        assert num > 6
        r = c.post("/v1/compare", json={"models": ["a", "b"], "input": " one", "context": context})
        message = refusal(r, 400, "input")
    assert "at most 6 tokens, context and input together (max_vocab_positions" in message
    assert f"this request has {num}." in message and "limits.vocab_positions" in message
    assert len(two[0].calls) == 1


def test_one_hold_for_both_models(tokenizer):
    """While the two passes run, the hold has both models' tokens; afterwards nothing."""
    a, b = pair_of(tokenizer, step_delay=0.4)

    async def main():
        app = app_of([a, b])
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            run = asyncio.create_task(c.post("/v1/compare", json={"models": ["a", "b"], "input": TEXT}))
            held = 0
            for _ in range(100):
                await asyncio.sleep(0.02)
                held = (await c.get("/health")).json()["tokens_held"]
                if held:
                    break
            done = await run
            after = (await c.get("/health")).json()
        return held, done, after

    held, done, after = asyncio.run(main())
    num = len(tokenizer(TEXT).input_ids)
    assert done.status_code == 200 and held == 2 * num
    assert after["tokens_held"] == 0 and after["requests_running"] == 0


def test_a_failing_model_stops_the_other(tokenizer):
    a, b = pair_of(tokenizer, step_delay=0.5)
    b.fail_with = RuntimeError("boom")
    app = app_of([a, b])
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/v1/compare", json={"models": ["a", "b"], "input": TEXT})
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
        assert "boom" not in r.text
        assert c.get("/health").json()["tokens_held"] == 0
    assert len(a.cancelled) == 1 and a.in_flight == 0  # a's pass was cancelled, not left running
