"""Every refusal: status, envelope, exact message, param, and the request id."""

from __future__ import annotations

import re

import pytest

BASE = {"model": "tiny", "prompt": "The sky is", "max_tokens": 2}


def refuse(client, body=None, status=400, raw=None, path="/v1/completions", method="post"):
    if raw is not None:
        r = client.request(method, path, content=raw, headers={"content-type": "application/json"})
    else:
        r = client.request(method, path, json=body)
    assert r.status_code == status, r.text
    data = r.json()
    assert set(data) == {"error", "request_id"}
    assert set(data["error"]) == {"message", "type", "param", "code"}
    assert re.fullmatch(r"req_[0-9a-f]{32}", data["request_id"])
    assert r.headers["x-request-id"] == data["request_id"]
    assert "Traceback" not in r.text
    return data["error"]


def test_logprobs_true_has_the_seed_message(fake_client):
    err = refuse(fake_client, {**BASE, "logprobs": True})
    assert err == {"message": "Invalid type for 'logprobs': expected a number or null.",
                   "type": "invalid_request_error", "param": "logprobs", "code": "invalid_request"}


@pytest.mark.parametrize("value,message", [
    (-1, "Invalid value for 'logprobs': expected a value greater than or equal to 0."),
    (101, "Invalid value for 'logprobs': expected a value less than or equal to 100."),
])
def test_logprobs_range_messages(fake_client, value, message):
    err = refuse(fake_client, {**BASE, "logprobs": value})
    assert err["message"] == message and err["param"] == "logprobs" and err["code"] == "invalid_request"


@pytest.mark.parametrize("field,value,message", [
    ("max_tokens", -1, "Invalid value for 'max_tokens': expected a value greater than or equal to 0."),
    ("max_tokens", "5", "Invalid type for 'max_tokens': expected a number or null."),
    ("max_tokens", 1.5, "Invalid type for 'max_tokens': expected an integer or null."),
    ("temperature", 2.5, "Invalid value for 'temperature': expected a value less than or equal to 2."),
    ("temperature", -0.1, "Invalid value for 'temperature': expected a value greater than or equal to 0."),
    ("temperature", True, "Invalid type for 'temperature': expected a number or null."),
    ("top_p", 0, "Invalid value for 'top_p': expected a value greater than 0."),
    ("top_p", 1.01, "Invalid value for 'top_p': expected a value less than or equal to 1."),
    ("top_k", -2, "Invalid value for 'top_k': expected a value greater than or equal to -1."),
    ("n", 0, "Invalid value for 'n': expected a value greater than or equal to 1."),
    ("n", 17, "Invalid value for 'n': expected a value less than or equal to 16."),
    ("seed", 2**64, "Invalid value for 'seed': expected a value less than or equal to 9223372036854775807."),
    ("seed", [1], "Invalid type for 'seed': expected a number or null."),
    ("echo", 1, "Invalid type for 'echo': expected a boolean or null."),
    ("prompt_logprobs", True, "Invalid type for 'prompt_logprobs': expected a number or null."),
    ("prompt_logprobs", 101, "Invalid value for 'prompt_logprobs': expected a value less than or equal to 100."),
])
def test_numeric_and_type_templates(fake_client, field, value, message):
    err = refuse(fake_client, {**BASE, field: value})
    assert err["message"] == message
    assert err["param"] == field


def test_unknown_field_is_refused_by_name(fake_client):
    err = refuse(fake_client, {**BASE, "temprature": 0})
    assert err["message"] == "Unrecognized request argument supplied: temprature"
    assert err["param"] == "temprature"


def test_unimplemented_openai_field(fake_client):
    err = refuse(fake_client, {**BASE, "presence_penalty": 0.5})
    assert err["param"] == "presence_penalty" and "does not implement" in err["message"]
    ok = fake_client.post("/v1/completions", json={**BASE, "presence_penalty": 0, "best_of": 1, "logit_bias": {}})
    assert ok.status_code == 200


def test_unknown_model_is_404(fake_client):
    err = refuse(fake_client, {**BASE, "model": "gpt-5"}, status=404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "gpt-5" in err["message"]


def test_full_name_and_alias_both_work(fake_client):
    for name in ("tiny", "test/tiny-llama"):
        r = fake_client.post("/v1/completions", json={**BASE, "model": name, "max_tokens": 1})
        assert r.status_code == 200
        assert r.json()["model"] == "test/tiny-llama"


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"text"', b"\xff\xfe"])
def test_malformed_body(fake_client, raw):
    err = refuse(fake_client, raw=raw)
    assert err["code"] == "invalid_request" and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("prompt", [None, 5, [], [1, "a"], [[1], []], [True], {"a": 1}])
def test_bad_prompts(fake_client, prompt):
    body = {**BASE, "prompt": prompt}
    if prompt is None:
        del body["prompt"]
    err = refuse(fake_client, body)
    assert err["param"] == "prompt"


def test_token_ids_outside_vocabulary(fake_client, fake_backend):
    for bad in (-1, fake_backend.info.vocab_size):
        err = refuse(fake_client, {**BASE, "prompt": [1, bad]})
        assert err["param"] == "prompt" and str(bad) in err["message"]


def test_empty_text_prompt_without_bos(fake_client):
    err = refuse(fake_client, {**BASE, "prompt": ""})
    assert err["param"] == "prompt"


def test_missing_model(fake_client):
    err = refuse(fake_client, {"prompt": "x"})
    assert err["message"] == "Missing required parameter: 'model'." and err["param"] == "model"


def test_stop_rules(fake_client):
    assert refuse(fake_client, {**BASE, "stop": ["a", "b", "c", "d", "e"]})["param"] == "stop"
    assert refuse(fake_client, {**BASE, "stop": [1]})["param"] == "stop"


def test_too_many_prompts(fake_client):
    err = refuse(fake_client, {**BASE, "prompt": ["a"] * 257})
    assert err["param"] == "prompt" and "256" in err["message"] and "257" in err["message"]


def test_echo_logprob_positions_cap(fake_client):
    from logprobe.config import Limits

    cap = Limits().max_prompt_logprob_positions
    # 200 prompts of 200 tokens with echo + logprobs: 40,000 positions > 32,768.
    body = {**BASE, "prompt": [[7] * 200] * 200, "echo": True, "logprobs": 1, "max_tokens": 0}
    err = refuse(fake_client, body)
    assert err["param"] == "logprobs" and str(cap) in err["message"] and "40000" in err["message"]


def test_body_size_cap(fake_client):
    big = b'{"model": "tiny", "prompt": "' + b"a" * (16 * 1024 * 1024) + b'"}'
    err = refuse(fake_client, raw=big, status=413)
    assert err["code"] == "request_too_large"


def test_not_found_and_method_not_allowed(fake_client):
    assert refuse(fake_client, {}, status=404, path="/v2/nothing")["code"] == "not_found"
    assert refuse(fake_client, None, status=405, path="/v1/completions", method="get")["code"] == "method_not_allowed"


def test_success_carries_a_request_id(fake_client):
    r = fake_client.post("/v1/completions", json={**BASE, "max_tokens": 1})
    assert re.fullmatch(r"req_[0-9a-f]{32}", r.headers["x-request-id"])
    assert re.fullmatch(r"cmpl-[0-9a-f]{16}", r.json()["id"])


def test_internal_error_has_no_internals(client, tiny_engine, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("secret internal detail /path/to/file.py")

    monkeypatch.setattr(tiny_engine.runner, "prefill_chunks", boom)
    err = refuse(client, {**BASE, "max_tokens": 1}, status=500)
    assert err["type"] == "server_error" and err["code"] == "internal_error"
    assert "secret" not in err["message"]
    monkeypatch.undo()
    assert client.post("/v1/completions", json={**BASE, "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("escape,column", [(b"\\ud800", 38), (b"\\udfff", 38), (b"\\ud83d\\u0041", 38)])
@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_a_lone_surrogate_is_named_not_called_invalid_json(fake_client, path, escape, column):
    """JSON allows the escape of half a UTF-16 surrogate pair; it is no Unicode character, so it is
    refused, saying what and where it is, rather than as "not valid JSON"."""
    raw = b'{"model": "tiny", "prompt": "The sky ' + escape + b' is", "max_tokens": 1}'
    err = refuse(fake_client, raw=raw, path=path)
    shown = escape[:6].decode()
    assert err == {"message": "We could not parse the JSON body of your request: it contains a lone UTF-16 "
                              f"surrogate ({shown}) at line 1, column {column}, which is not a Unicode character; "
                              "a surrogate escape must be a high one (\\ud800-\\udbff) followed by a low one "
                              "(\\udc00-\\udfff). Send the text as valid Unicode.",
                   "type": "invalid_request_error", "param": None, "code": "invalid_request"}


def test_a_surrogate_pair_is_one_character(fake_client):
    raw = b'{"model": "tiny", "prompt": "smile \\ud83d\\ude42"}'
    r = fake_client.post("/tokenize", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    direct = fake_client.post("/tokenize", json={"model": "tiny", "prompt": "smile \U0001F642"}).json()
    assert r.json()["tokens"] == direct["tokens"]
