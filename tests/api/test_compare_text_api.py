"""POST /v1/compare with `align: "text"` on fake models of different tokenizers (SmolLM2's byte-level BPE
and TinyTokenizer's one byte a token): spans, their log probabilities (against float64 sums over the
fakes' own rows), bits per byte, disagreements, the same requests as /v1/score, and every refusal
before any work."""

from __future__ import annotations

import math

import numpy as np
import pytest
from fastapi.testclient import TestClient

from fake_backend import FakeBackend, TinyTokenizer
from logprobe.api.app import attach_backends, create_app
from logprobe.config import Limits

TEXT = "Naïve café: 日本 🙂 ok"


@pytest.fixture
def three(tokenizer):
    smol = FakeBackend(tokenizer, name="lab/smol", aliases=("smol",), context_length=256)
    smol_b = FakeBackend(tokenizer, name="lab/smol-b", aliases=("smol-b",), context_length=256, salt=0x5A17)
    tiny = FakeBackend(TinyTokenizer(), name="lab/tiny", aliases=("tiny",), context_length=40)
    return smol, smol_b, tiny


def client_of(backends) -> TestClient:
    app = create_app(None, Limits())
    attach_backends(app, list(backends))
    return TestClient(app, raise_server_exceptions=False)


def own_numbers(backend, text: str, context: str | None = None):
    """What /v1/score computes for the text: [start] + context + input, each input token's float32 log
    probability, and each token's bytes."""
    tok, info = backend.tokenizer, backend.info
    start = info.bos_token_id if info.bos_token_id is not None else info.eos_token_id
    head = [start] + (tok(context, add_special_tokens=False).input_ids if context else [])
    ids = tok(text, add_special_tokens=False).input_ids
    full = head + ids
    lps = [float(backend.logprobs_after(full[:i])[full[i]]) for i in range(len(head), len(full))]
    return ids, lps, [backend.table.token_bytes[t] for t in ids]


def spans_by_hand(text: str, pieces_of: list[list[bytes]]) -> list[int]:
    """Byte offsets where every tokenization and the text's characters have a boundary, counted here."""
    data = text.encode()
    chars = {len(text[:i].encode()) for i in range(len(text) + 1)}
    common = chars
    for pieces in pieces_of:
        ends, at = {0}, 0
        for p in pieces:
            at += len(p)
            ends.add(at)
        common &= ends
    assert max(common) == len(data)
    return sorted(common)


def test_spans_numbers_and_summary(three):
    smol, _, tiny = three
    with client_of(three) as c:
        r = c.post("/v1/compare", json={"models": ["smol", "tiny"], "input": TEXT, "align": "text"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "span_comparison" and out["models"] == ["lab/smol", "lab/tiny"]
    ids_s, lps_s, pieces_s = own_numbers(smol, TEXT)
    ids_t, lps_t, pieces_t = own_numbers(tiny, TEXT)
    bounds = spans_by_hand(TEXT, [pieces_s, pieces_t])
    spans = out["spans"]
    assert spans["byte_offset"] == bounds[:-1]
    data = TEXT.encode()
    assert spans["text"] == [data[a:b].decode() for a, b in zip(bounds[:-1], bounds[1:])]
    assert "".join(spans["text"]) == TEXT
    assert [TEXT[o:o + len(t)] for o, t in zip(spans["text_offset"], spans["text"])] == spans["text"]
    for which, (ids, lps, pieces) in enumerate([(ids_s, lps_s, pieces_s), (ids_t, lps_t, pieces_t)]):
        starts = np.cumsum([0] + [len(p) for p in pieces])[:-1]
        span_of = [max(i for i, b in enumerate(bounds[:-1]) if b <= s) for s in starts]
        want = [math.fsum(lp for lp, sp in zip(lps, span_of) if sp == i) for i in range(len(bounds) - 1)]
        np.testing.assert_allclose([row[which] for row in spans["logprobs"]], want, rtol=1e-12, atol=1e-12)
        assert [row[which] for row in spans["num_tokens"]] == [span_of.count(i) for i in range(len(want))]
        tokenization = out["tokenizations"][which]
        assert tokenization["token_ids"] == ids and tokenization["span"] == span_of
        assert tokenization["byte_offset"] == starts.tolist()
        np.testing.assert_allclose(tokenization["token_logprobs"], lps, rtol=0, atol=0)
        total = math.fsum(lps)
        assert out["summary"]["logprob"][which] == pytest.approx(total, rel=1e-12)
        assert out["summary"]["bits_per_byte"][which] == pytest.approx(-total / math.log(2) / len(data), rel=1e-12)
        assert out["summary"]["num_tokens"][which] == len(ids)
    diff = [b - a for a, b in spans["logprobs"]]
    assert [d[0] for d in spans["difference"]] == pytest.approx(diff, abs=1e-12)
    assert spans["spread"] == pytest.approx([abs(d) for d in diff], abs=1e-12)
    order = sorted(range(len(diff)), key=lambda i: (-abs(diff[i]), i))[:10]
    assert out["disagreements"] == order
    summary = out["summary"]
    assert (summary["num_spans"], summary["num_bytes"], summary["num_characters"]) == (len(bounds) - 1, len(data), len(TEXT))
    assert out["usage"]["prompt_tokens"] == len(ids_s) + len(ids_t) + 2  # each model's start token


def test_a_character_split_by_both_is_one_span(three):
    """日 is three bytes; TinyTokenizer cuts after each, SmolLM2's byte-level BPE cuts inside it too. No
    span ends inside a character."""
    with client_of(three) as c:
        out = c.post("/v1/compare", json={"models": ["tiny", "smol"], "input": " 日本", "align": "text"}).json()
    for text in out["spans"]["text"]:
        assert text.encode().decode() == text and "\ufffd" not in text
    smol_tokens = out["tokenizations"][1]["tokens"]
    assert any(t.startswith("bytes:") for t in smol_tokens)  # a token that is a piece of a character


def test_three_models_and_differences_from_the_first(three):
    with client_of(three) as c:
        out = c.post("/v1/compare", json={"models": ["smol", "smol-b", "tiny"], "input": "The sky", "align": "text",
                                          "context": "Look:"}).json()
    lps = np.array(out["spans"]["logprobs"])
    assert lps.shape[1] == 3
    np.testing.assert_allclose(out["spans"]["difference"], lps[:, 1:] - lps[:, :1], atol=1e-12)
    np.testing.assert_allclose(out["spans"]["spread"], lps.max(1) - lps.min(1), atol=1e-12)
    ids, lps_s, _ = own_numbers(three[0], "The sky", "Look:")
    assert out["summary"]["logprob"][0] == pytest.approx(math.fsum(lps_s), rel=1e-12)


def test_each_model_runs_its_score_request(three):
    """The same engine requests as /v1/score of the text, one per model, in one hold."""
    smol, _, tiny = three
    with client_of(three) as c:
        assert c.post("/v1/compare", json={"models": ["smol", "tiny"], "input": "a b", "align": "text"}).status_code == 200
        compared = [b.requests[-1] for b in (smol, tiny)]
        for name in ("smol", "tiny"):
            assert c.post("/v1/score", json={"model": name, "input": "a b"}).status_code == 200
        scored = [b.requests[-1] for b in (smol, tiny)]
    for a, b in zip(compared, scored):
        assert a.prompt_ids == b.prompt_ids and a.params == b.params


def test_special_tokens_in_the_text_are_their_own_text(three):
    with client_of(three) as c:
        out = c.post("/v1/compare", json={"models": ["smol", "tiny"], "input": "hi <s> there", "align": "text"}).json()
    assert "".join(out["spans"]["text"]) == "hi <s> there"
    tiny = out["tokenizations"][1]
    at = tiny["token_ids"].index(256)  # TinyTokenizer's <s>, read as one token
    assert tiny["tokens"][at] == "<s>" and tiny["byte_offset"][at] == 3
    assert "<s>" in out["spans"]["text"][tiny["span"][at]]


def refusal(r, status: int, param: str | None, code: str = "invalid_request") -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert (body["error"]["param"], body["error"]["code"]) == (param, code), body
    return body["error"]["message"]


@pytest.mark.parametrize("body,status,param,words", [
    ({"models": ["smol"]}, 400, "models", "two or more with 'align': 'text'), got 1"),
    ({"models": ["smol", "nope"]}, 404, "models", "The model `nope` does not exist"),
    ({"models": ["smol", "tiny", "lab/smol"]}, 400, "models", "'smol' and 'lab/smol' are both the model lab/smol"),
    ({"models": ["smol", "tiny"], "input": [1, 2]}, 400, "input", "with 'align': 'text' the input is a text"),
    ({"models": ["smol", "tiny"], "input": ""}, 400, "input", "has no tokens"),
    ({"models": ["smol", "tiny"], "align": "bytes"}, 400, "align", "'tokens' or 'text'"),
    ({"models": ["smol", "tiny"], "add_special_tokens": False}, 400, "add_special_tokens", "send a 'context'"),
    ({"models": ["smol", "tiny"], "input": "x" * 60}, 400, "input", "maximum context length is 40"),
    ({"models": ["smol", "tiny"], "stream": True}, 400, "stream", "does not stream"),
])
def test_refusals_before_any_work(three, body, status, param, words):
    body = {"input": TEXT, "align": "text", **body}
    with client_of(three) as c:
        code = ("model_not_found" if status == 404 else
                "context_length_exceeded" if "context length" in words else "invalid_request")
        message = refusal(c.post("/v1/compare", json=body), status, param, code)
    assert words in message
    assert all(b.calls == [] for b in three)


def test_align_tokens_refusals_point_to_text(three):
    with client_of(three) as c:
        message = refusal(c.post("/v1/compare", json={"models": ["smol", "tiny"], "input": TEXT}),
                          400, "models")
        assert "do not share a tokenizer" in message and "send 'align': 'text'" in message
        message = refusal(c.post("/v1/compare", json={"models": ["smol", "smol-b", "tiny"], "input": TEXT}), 400, "models")
        assert "expected two model names, got 3; to compare more than two, send 'align': 'text'" in message
    assert all(b.calls == [] for b in three)


def test_a_context_that_fills_the_context_length_names_input(three):
    """context + input over a model's context: the refusal names the field /v1/score names."""
    with client_of(three) as c:
        r = c.post("/v1/compare", json={"models": ["smol", "tiny"], "input": "ok", "context": "y" * 50,
                                        "align": "text"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


class Normalizing(TinyTokenizer):
    """TinyTokenizer, but it drops carriage returns: its tokens do not spell such a text back."""

    def encode(self, text, add_special_tokens=True):
        return super().encode(text.replace("\r", ""), add_special_tokens)


class RulesOutByte(FakeBackend):
    """A fake whose every distribution gives token 7 (TinyTokenizer's byte 0x07) probability zero."""

    def _row(self, a, b):
        row = super()._row(a, b).astype(np.float64)
        row[7] = -np.inf
        row -= np.log(np.exp(row).sum())
        return row.astype(np.float32)


def test_a_tokenizer_that_changes_the_text_is_refused(three):
    norm = FakeBackend(Normalizing(), name="lab/norm", aliases=("norm",))
    with client_of([*three, norm]) as c:
        r = c.post("/v1/compare", json={"models": ["smol", "norm"], "input": "a\r\nb", "align": "text"})
        message = refusal(r, 400, "input")
        assert "the tokens of lab/norm do not spell the text back" in message and "at byte 1" in message
        assert c.post("/v1/compare", json={"models": ["smol", "norm"], "input": "a\nb", "align": "text"}).status_code == 200
    assert [len(b.calls) for b in (*three, norm)] == [1, 0, 0, 1]


def test_a_ruled_out_token_is_written_minus_9999(three):
    """A span whose token a model gives probability zero: -9999.0 (the wire's -inf), and the differences
    and sums are of the written values."""
    smol, _, tiny = three
    zero = RulesOutByte(TinyTokenizer(), name="lab/zero", aliases=("zero",))
    with client_of([smol, tiny, zero]) as c:
        out = c.post("/v1/compare", json={"models": ["tiny", "zero"], "input": "a\x07b", "align": "text"}).json()
    assert out["spans"]["text"] == ["a", "\x07", "b"]
    lps = out["spans"]["logprobs"]
    assert lps[1][1] == -9999.0 and lps[1][0] > -9999.0 and lps[0][1] > -9999.0
    assert out["tokenizations"][1]["token_logprobs"][1] == -9999.0
    assert out["spans"]["difference"][1][0] == pytest.approx(-9999.0 - lps[1][0])
    assert out["summary"]["logprob"][1] == pytest.approx(lps[0][1] - 9999.0 + lps[2][1])
    assert out["disagreements"][0] == 1
