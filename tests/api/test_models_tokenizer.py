"""/v1/models, /v1/models/{model}, /tokenize, /detokenize, /tokenizer_info, /health."""

from __future__ import annotations


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
