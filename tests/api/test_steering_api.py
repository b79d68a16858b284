"""Steering fields over HTTP on the fake backend: `logit_bias`, `allowed_token_ids` and `bad_words` parsed
into the engine's parameters (bad words tokenized with and without a leading space), refused with the
contract's envelope naming the field before anything is held, their caps in the model card, and plain
requests' parameters unchanged. Their numbers are checked on the engine (tests/model/test_steering_reference.py)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from logprobe.api.app import create_app
from logprobe.api.checks.steering import bad_words_ids
from logprobe.backend import SamplingParams
from logprobe.config import Limits

MESSAGES = [{"role": "user", "content": "Pick A or B."}]
PATHS = ["/v1/completions", "/v1/chat/completions"]


def post(client, path, **body):
    body.setdefault("model", "tiny")
    if path == "/v1/completions":
        body.setdefault("prompt", "x")
    else:
        body.setdefault("messages", MESSAGES)
    return client.post(path, json=body)


def refused(client, param, path, **body):
    r = post(client, path, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["code"] == "invalid_request", err
    return err["message"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("field, value, words", [
    ("logit_bias", [1, 2], "Invalid type for 'logit_bias'"),
    ("logit_bias", {"abc": 1}, "is not a token id"),
    ("logit_bias", {"5": 101}, "from -100 to 100"),
    ("logit_bias", {"5": -100.5}, "from -100 to 100"),
    ("logit_bias", {"5": "1"}, "from -100 to 100"),
    ("logit_bias", {"5": True}, "from -100 to 100"),
    ("logit_bias", {"5": 1, " 5": 2}, "more than once"),
    ("logit_bias", {"49152": 1}, "outside the vocabulary of 49152 tokens (ids 0 to 49151)"),
    ("logit_bias", {"-1": 1}, "outside the vocabulary"),
    ("allowed_token_ids", [], "at least one token id"),
    ("allowed_token_ids", [1, "2"], "Invalid type for 'allowed_token_ids'"),
    ("allowed_token_ids", 5, "Invalid type for 'allowed_token_ids'"),
    ("allowed_token_ids", [1, 10**6], "token id 1000000 is outside the vocabulary"),
    ("bad_words", "word", "Invalid type for 'bad_words'"),
    ("bad_words", ["ok", 3], "Invalid type for 'bad_words'"),
    ("bad_words", ["ok", "  "], "not empty"),
])
def test_refusals_name_the_field_before_anything_is_held(fake_client, fake_backend, path, field, value, words):
    fake_backend.reset_records()
    assert words in refused(fake_client, field, path, max_tokens=2, **{field: value})
    assert not fake_backend.calls and fake_client.get("/health").json()["tokens_held"] == 0


def test_bad_words_that_ban_every_allowed_token(fake_client, fake_backend, tokenizer):
    token = tokenizer(" the", add_special_tokens=False).input_ids
    assert len(token) == 1
    message = refused(fake_client, "bad_words", "/v1/completions", allowed_token_ids=token, bad_words=[" the", "the"])
    assert "every token of 'allowed_token_ids'" in message


def test_caps_are_in_the_model_card(fake_backend):
    with TestClient(create_app(fake_backend, Limits(max_logit_bias=2, max_bad_words=1))) as c:
        limits = c.get("/v1/models/tiny").json()["limits"]
        assert limits["max_logit_bias"] == 2 and limits["max_bad_words"] == 1
        for path in PATHS:
            assert "at most 2 (max_logit_bias)" in refused(c, "logit_bias", path, logit_bias={"1": 1, "2": 1, "3": 1})
            assert "at most 1 (max_bad_words)" in refused(c, "bad_words", path, bad_words=["a", "b"])
    assert Limits().max_logit_bias == 300


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("stream", [False, True])
def test_fields_reach_the_engine(fake_client, fake_backend, tokenizer, path, stream):
    fake_backend.reset_records()
    r = post(fake_client, path, max_tokens=2, stream=stream, logit_bias={"330": -100, "17": 2.5},
             allowed_token_ids=[17, 330, 389], bad_words=["hello world"])
    assert r.status_code == 200, r.text
    params = fake_backend.requests[-1].params
    assert params.logit_bias == ((330, -100.0), (17, 2.5)) and params.allowed_token_ids == (17, 330, 389)
    assert params.bad_words_ids == bad_words_ids(tokenizer, ("hello world",)) and params.is_steered and params.is_masked


def test_bad_words_are_tokenized_with_and_without_a_space(tokenizer):
    ids = bad_words_ids(tokenizer, ("hello", " hello", "hello world"))
    bare = tuple(tokenizer("hello", add_special_tokens=False).input_ids)
    spaced = tuple(tokenizer(" hello", add_special_tokens=False).input_ids)
    assert bare != spaced and ids[:2] == (bare, spaced)  # " hello" repeats "hello": kept once
    assert tuple(tokenizer(" hello world", add_special_tokens=False).input_ids) in ids
    assert len(ids) == 4


@pytest.mark.parametrize("path", PATHS)
def test_empty_values_are_the_plain_request(fake_client, fake_backend, path):
    """null, {} and [] leave the parameters a plain request has (allowed_token_ids: [] is refused)."""
    fake_backend.reset_records()
    assert post(fake_client, path, max_tokens=2, seed=1).status_code == 200
    plain = fake_backend.requests[-1].params
    assert post(fake_client, path, max_tokens=2, seed=1, logit_bias={}, bad_words=[],
                allowed_token_ids=None).status_code == 200
    same = fake_backend.requests[-1].params
    assert same == plain and not same.is_steered
    assert plain == SamplingParams(**{**plain.__dict__, **{name: getattr(SamplingParams(), name) for name in (
        "logit_bias", "allowed_token_ids", "bad_words_ids")}})


def test_fields_are_in_the_openapi_schema(fake_client):
    schemas = fake_client.get("/openapi.json").json()["components"]["schemas"]
    for name in ("CompletionBody", "ChatBody"):
        properties = schemas[name]["properties"]
        assert {"logit_bias", "allowed_token_ids", "bad_words"} <= set(properties)
        assert "Not implemented" not in properties["logit_bias"].get("description", "")


def streamed_choices(text: str) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for line in text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                out.setdefault(choice["index"], []).append(choice)
    return out


@pytest.mark.parametrize("echo", [False, True])
def test_both_modes_stream_as_they_answer(fake_client, echo):
    """`logprobs_mode: both` streams: each chunk's `processed_logprobs` holds its tokens' entries, and
    together they are the answer's."""
    body = dict(prompt="The sky", max_tokens=5, n=2, seed=3, temperature=0.8, logprobs=2, logprobs_mode="both",
                echo=echo)
    whole = post(fake_client, "/v1/completions", **body).json()["choices"]
    streamed = streamed_choices(post(fake_client, "/v1/completions", **body, stream=True).text)
    for choice in whole:
        chunks = streamed[choice["index"]]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert sum((c["processed_logprobs"][key] for c in chunks), []) == choice["processed_logprobs"][key]
            assert sum((c["logprobs"][key] for c in chunks), []) == choice["logprobs"][key]


def test_both_modes_stream_in_chat(fake_client):
    body = dict(max_tokens=5, seed=3, temperature=0.8, logprobs=True, top_logprobs=2, logprobs_mode="both")
    whole = post(fake_client, "/v1/chat/completions", **body).json()["choices"][0]
    chunks = streamed_choices(post(fake_client, "/v1/chat/completions", **body, stream=True).text)[0]
    content = sum((c["processed_logprobs"]["content"] for c in chunks if c.get("processed_logprobs")), [])
    assert content == whole["processed_logprobs"]["content"] and content
