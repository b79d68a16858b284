"""Streaming (SSE framing, deltas, usage, errors) and chat completions. Formats and refusals on the fake
backend (`fake_client`); streamed against non-streamed answers, and numbers against the float64
reference, on the tiny model (`client`)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from faults import inject_failure

TOL = 1e-5


def events(client, path, body):
    """The SSE events of a streamed request: a list of parsed JSON payloads, then "[DONE]"."""
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes())
    assert raw.endswith(b"data: [DONE]\n\n")
    out = []
    for block in raw.split(b"\n\n")[:-1]:
        assert block.startswith(b"data: "), block
        payload = block[len(b"data: "):]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    assert out[-1] == "[DONE]" and out.count("[DONE]") == 1
    return out[:-1]


def merge_completion_stream(chunks):
    """Rebuild per-choice text and logprobs lists from completion chunks."""
    merged = {}
    for c in chunks:
        for ch in c["choices"]:
            m = merged.setdefault(ch["index"], {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                "text_offset": [], "finish_reason": None})
            m["text"] += ch["text"]
            if ch["logprobs"]:
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    m[key] += ch["logprobs"][key]
            if ch["finish_reason"]:
                assert m["finish_reason"] is None
                m["finish_reason"] = ch["finish_reason"]
    return merged


@pytest.mark.parametrize("extra", [
    {},
    {"echo": True},
    {"stop": [" the", "xyz"], "max_tokens": 30},
    {"n": 3, "prompt": ["first prompt", "second one"]},
    {"temperature": 0, "logprobs": 0},
])
def test_streamed_equals_non_streamed(client, extra):
    body = {"model": "tiny", "prompt": "Streaming should match", "max_tokens": 12, "logprobs": 3, "seed": 99, **extra}
    plain = client.post("/v1/completions", json=body).json()
    chunks = events(client, "/v1/completions", {**body, "stream": True})
    merged = merge_completion_stream(chunks)
    assert sorted(merged) == [c["index"] for c in plain["choices"]]
    for choice in plain["choices"]:
        m = merged[choice["index"]]
        assert m["text"] == choice["text"]
        assert m["finish_reason"] == choice["finish_reason"]
        lp = choice["logprobs"]
        assert m["tokens"] == lp["tokens"]
        assert m["text_offset"] == lp["text_offset"]  # offsets continue across chunks
        assert m["top_logprobs"] == lp["top_logprobs"]
        got = [x for x in m["token_logprobs"] if x is not None]
        want = [x for x in lp["token_logprobs"] if x is not None]
        np.testing.assert_allclose(got, want, atol=TOL)
    for c in chunks:
        assert c["object"] == "text_completion" and c["id"] == chunks[0]["id"]
        assert "usage" not in c  # no include_usage


def test_each_chunk_carries_its_tokens_text(fake_client):
    chunks = events(fake_client, "/v1/completions", {"model": "tiny", "prompt": "Chunk by chunk", "max_tokens": 8,
                                                 "logprobs": 1, "stream": True, "seed": 1})
    for c in chunks:
        ch = c["choices"][0]
        tokens = ch["logprobs"]["tokens"] if ch["logprobs"] else []
        if all(not t.startswith("bytes:") for t in tokens):
            assert "".join(tokens) == ch["text"]
        assert len(tokens) <= 1  # one decode step per chunk


def test_include_usage_final_chunk(fake_client):
    body = {"model": "tiny", "prompt": ["a", "b"], "n": 2, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}, "seed": 4}
    chunks = events(fake_client, "/v1/completions", body)
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 20
    assert last["usage"]["prompt_tokens"] == sum(
        len(fake_client.post("/tokenize", json={"prompt": p}).json()["tokens"]) for p in ("a", "b"))
    assert all(c["usage"] is None for c in chunks[:-1])
    indexes = {c["choices"][0]["index"] for c in chunks[:-1]}
    assert indexes == {0, 1, 2, 3}


def test_stream_options_without_stream(fake_client):
    r = fake_client.post("/v1/completions",
                         json={"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_error_after_stream_began_is_an_event(client, tiny_engine, monkeypatch):
    inject_failure(monkeypatch, tiny_engine.runner, "decode_and_pick", 3, RuntimeError("boom inside"))
    chunks = events(client, "/v1/completions", {"model": "tiny", "prompt": "x y", "max_tokens": 10, "stream": True})
    assert "error" in chunks[-1]
    err = chunks[-1]["error"]
    assert err["code"] == "internal_error" and "boom" not in err["message"]
    assert any("choices" in c for c in chunks[:-1])  # some text went out before the error
    monkeypatch.undo()
    assert client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}).status_code == 200


# ---- chat -----------------------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}]


def test_chat_logprobs_against_reference(client, reference, tiny_engine):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "logprobs": True, "top_logprobs": 4,
            "seed": 2, "return_tokens_as_token_ids": True}
    out = client.post("/v1/chat/completions", json=body).json()
    assert out["object"] == "chat.completion"
    text = tiny_engine.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    prompt_ids = tiny_engine.tokenizer(text, add_special_tokens=False).input_ids
    assert out["usage"]["prompt_tokens"] == len(prompt_ids)
    content = out["choices"][0]["logprobs"]["content"]
    gen = [int(e["token"].split(":")[1]) for e in content]
    ref = reference.logprobs(prompt_ids + gen).numpy()
    for i, entry in enumerate(content):
        row = ref[len(prompt_ids) - 1 + i]
        assert abs(entry["logprob"] - row[gen[i]]) < TOL
        assert entry["bytes"] == list(tiny_engine.table.token_bytes[gen[i]])
        tops = entry["top_logprobs"]
        assert len(tops) == 4
        values = [t["logprob"] for t in tops]
        assert values == sorted(values, reverse=True)
        expected = np.sort(row)[::-1][:4]
        np.testing.assert_allclose(values, expected, atol=TOL)


def test_chat_streamed_equals_non_streamed(client):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 10, "logprobs": True, "top_logprobs": 2,
            "n": 2, "seed": 8}
    plain = client.post("/v1/chat/completions", json=body).json()
    chunks = events(client, "/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"] == plain["usage"] and chunks[-1]["choices"] == []
    for choice in plain["choices"]:
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == choice["index"]]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["delta"].get("content", "") for c in mine)
        content = [e for c in mine if c["logprobs"] for e in c["logprobs"]["content"]]
        assert text == choice["message"]["content"]
        assert [e["token"] for e in content] == [e["token"] for e in choice["logprobs"]["content"]]
        np.testing.assert_allclose([e["logprob"] for e in content],
                                   [e["logprob"] for e in choice["logprobs"]["content"]], atol=TOL)
        assert mine[-1]["finish_reason"] == choice["finish_reason"]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_chat_errors(fake_client):
    def err(body, status=400):
        r = fake_client.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, **body})
        assert r.status_code == status, r.text
        return r.json()["error"]

    assert err({"top_logprobs": 3})["param"] == "top_logprobs"
    assert err({"logprobs": 5})["message"] == "Invalid type for 'logprobs': expected a boolean or null."
    assert err({"logprobs": True, "top_logprobs": 101})["message"] == (
        "Invalid value for 'top_logprobs': expected a value less than or equal to 100.")
    assert err({"messages": []})["param"] == "messages"
    assert err({"messages": [{"role": "robot", "content": "x"}]})["param"] == "messages"
    assert err({"tools": [{"type": "function"}]})["param"] == "tools"
    assert err({"prompt_logprobs": 1, "stream": True})["param"] == "prompt_logprobs"
    assert err({"model": "nope"}, status=404)["code"] == "model_not_found"
    assert err({"max_tokens": 300})["code"] == "context_length_exceeded"


def test_chat_prompt_logprobs_over_templated_prompt(client, reference, tiny_engine):
    out = client.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 1,
                                                     "prompt_logprobs": 2}).json()
    text = tiny_engine.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tiny_engine.tokenizer(text, add_special_tokens=False).input_ids
    plp = out["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    ref = reference.logprobs(ids).numpy()
    for pos in range(1, len(ids)):
        own = plp[pos][str(ids[pos])]
        assert abs(own["logprob"] - ref[pos - 1][ids[pos]]) < TOL


def test_chat_without_template_is_refused(tiny_engine, tiny_model, tokenizer):
    import copy

    from fastapi.testclient import TestClient

    from logprobe.api.app import create_app
    from logprobe.engine.engine import Engine

    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    engine = Engine(tiny_model, bare, "bare", [])
    engine.start()
    try:
        with TestClient(create_app(engine)) as c:
            r = c.post("/v1/chat/completions", json={"model": "bare", "messages": MESSAGES})
            assert r.status_code == 400
            msg = r.json()["error"]["message"]
            assert "/v1/completions" in msg and "--chat-template" in msg
            assert c.get("/v1/models/bare").json()["has_chat_template"] is False
    finally:
        engine.stop()
