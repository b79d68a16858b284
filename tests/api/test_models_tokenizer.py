"""/v1/models, /v1/models/{model}, /tokenize, /detokenize, /tokenizer_info, /health."""

from __future__ import annotations

import copy

import pytest
from fastapi.testclient import TestClient

from fake_backend import FakeBackend
from logprobe.api.app import create_app
from logprobe.config import Limits


def test_model_list_and_card(client, tiny_engine, tiny_model):
    data = client.get("/v1/models").json()
    assert data["object"] == "list" and [m["id"] for m in data["data"]] == ["test/tiny-llama"]
    for name in ("tiny", "test/tiny-llama"):
        card = client.get(f"/v1/models/{name}").json()
        assert card["id"] == "test/tiny-llama" and card["aliases"] == ["tiny"]
        assert card["num_layers"] == tiny_model.config.num_hidden_layers == 2
        assert card["d_model"] == 64
        assert card["vocab_size"] == tiny_model.config.vocab_size
        assert card["context_length"] == 256
        assert card["dtype"] == "float32"
        assert card["adds_bos"] is False  # SmolLM2's tokenizer adds no BOS
        assert card["has_chat_template"] is True
        assert card["limits"]["max_n"] == 16 and card["limits"]["max_vocab_positions"] == 256
        assert card["limits"]["max_body_bytes"] == 16 * 1024 * 1024
    r = client.get("/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_tokenize_roundtrip(fake_client, tokenizer):
    r = fake_client.post("/tokenize", json={"model": "tiny", "prompt": "Hello world"}).json()
    assert r["tokens"] == tokenizer("Hello world").input_ids
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    back = fake_client.post("/detokenize", json={"model": "tiny", "tokens": r["tokens"]}).json()
    assert back == {"prompt": "Hello world"}
    r2 = fake_client.post("/tokenize", json={"prompt": "<|im_start|>hi", "add_special_tokens": False}).json()
    assert r2["tokens"][0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_tokenize_a_conversation_as_chat_sends_it(fake_client, tokenizer):
    """`messages` on /tokenize (as vLLM's): the chat template's rendering, as `prompt`, and the token ids
    /v1/chat/completions sends the model (its usage counts them); without the generation prompt the
    rendering ends with the last message; the tokenizer adds its own special tokens only when asked."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    r = fake_client.post("/tokenize", json={"model": "tiny", "messages": messages})
    assert r.status_code == 200, r.text
    got = r.json()
    want = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert got["prompt"] == want and want.endswith("<|im_start|>assistant\n")
    assert got["tokens"] == tokenizer(want, add_special_tokens=False).input_ids and got["count"] == len(got["tokens"])
    chat = fake_client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 1,
                                                          "temperature": 0}).json()
    assert chat["usage"]["prompt_tokens"] == got["count"]
    bare = fake_client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert bare["prompt"] == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert want.startswith(bare["prompt"]) and bare["count"] < got["count"]
    special = fake_client.post("/tokenize", json={"messages": messages, "add_special_tokens": True}).json()
    assert special["tokens"] == tokenizer(want).input_ids
    # the rendered text back through /tokenize as a prompt, without the tokenizer's own special tokens
    again = fake_client.post("/tokenize", json={"prompt": got["prompt"], "add_special_tokens": False}).json()
    assert again["tokens"] == got["tokens"] and "prompt" not in again


@pytest.mark.parametrize("body, param, words", [
    ({}, "prompt", "Missing required parameter: 'prompt' (or 'messages')."),
    ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "messages", "either 'prompt' or 'messages'"),
    ({"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt", "applies to 'messages'"),
    ({"messages": []}, "messages", "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages", "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "yes"}, "add_generation_prompt",
     "add_generation_prompt"),
])
def test_tokenize_refusals(fake_client, body, param, words):
    r = fake_client.post("/tokenize", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and words in error["message"], error


def test_tokenize_a_conversation_without_a_chat_template(tokenizer):
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    backend = FakeBackend(bare, name="bare", aliases=(), num_layers=2, d_model=64, context_length=256)
    with TestClient(create_app(backend, Limits()), raise_server_exceptions=False) as c:
        r = c.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert "no chat template" in r.json()["error"]["message"]
        assert c.post("/tokenize", json={"prompt": "x"}).status_code == 200


def test_tokenizer_errors(fake_client):
    r = fake_client.post("/tokenize", json={"prompt": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = fake_client.post("/detokenize", json={"tokens": [1, -5]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = fake_client.post("/tokenize", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404


def test_tokenizer_info(fake_client, tokenizer):
    info = fake_client.get("/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert info["vocab_size"] == len(tokenizer)


def test_health(fake_client):
    r = fake_client.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ready"
    assert r.headers["x-request-id"].startswith("req_")
