"""A real `logprobe serve` process on the bundled SmolLM2 model, driven by the openai SDK and raw HTTP."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m"
FULL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct-Q4_1"


def test_completion_logprobs_match_float64(oai, ref64):
    out = oai.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, logprobs=5, temperature=0,
                                 extra_body={"return_tokens_as_token_ids": True})
    assert out.model == FULL_NAME
    lp = out.choices[0].logprobs
    gen = [int(t.split(":")[1]) for t in lp.tokens]
    prompt_ids = [504, 6376, 314]
    ref = ref64(prompt_ids + gen)
    for i, t in enumerate(gen):
        row = ref[len(prompt_ids) - 1 + i]
        assert t == int(np.argmax(row))
        assert abs(lp.token_logprobs[i] - row[t]) < 2e-4
        top = lp.top_logprobs[i]
        assert len(top) == 5
        for name, value in top.items():
            assert abs(value - row[int(name.split(":")[1])]) < 2e-4
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 5


def test_openai_sdk_text_offsets_and_echo(oai):
    out = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, logprobs=2,
                                 echo=True, temperature=0)
    c = out.choices[0]
    assert c.text.startswith("The capital of France is")
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert len(c.logprobs.tokens) == out.usage.prompt_tokens + out.usage.completion_tokens
    for off, tok in zip(c.logprobs.text_offset, c.logprobs.tokens):
        assert c.text[off:off + len(tok)] == tok
    plain = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert c.text == "The capital of France is" + plain.choices[0].text


def test_max_tokens_zero_echo_scores_the_prompt(oai, ref64):
    out = oai.completions.create(model="smol", prompt="Paris is the capital of France.", max_tokens=0,
                                 echo=True, logprobs=0, extra_body={"return_tokens_as_token_ids": True})
    c = out.choices[0]
    ids = [int(t.split(":")[1]) for t in c.logprobs.tokens]
    ref = ref64(ids)
    got = np.array(c.logprobs.token_logprobs[1:])
    want = np.array([ref[i - 1][ids[i]] for i in range(1, len(ids))])
    np.testing.assert_allclose(got, want, atol=2e-4)
    assert c.text == "Paris is the capital of France." and out.usage.completion_tokens == 0


def test_n_with_seed_is_reproducible(oai):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, n=3, seed=42, temperature=1.0, logprobs=1)
    a = oai.completions.create(**kw)
    b = oai.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert len({c.text for c in a.choices}) > 1


def test_stop_and_token_id_prompts(oai):
    free = oai.completions.create(model=MODEL, prompt=[[504, 6376, 314], [504]], max_tokens=10, temperature=0)
    assert len(free.choices) == 2 and free.usage.prompt_tokens == 4
    text = free.choices[0].text
    stop = text.split()[1]
    out = oai.completions.create(model=MODEL, prompt=[504, 6376, 314], max_tokens=10, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[:text.index(stop)]


def test_raw_http_errors(server):
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "x", "logprobs": True}, timeout=600)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Invalid type for 'logprobs': expected a number or null."
    assert r.json()["request_id"] == r.headers["x-request-id"]
    r = httpx.post(server + "/v1/completions", json={"model": "llama-8b", "prompt": "x"}, timeout=600)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(server + "/v1/completions", content=b"{", headers={"content-type": "application/json"}, timeout=600)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": [1] * 8190, "max_tokens": 16},
                   timeout=600)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_model_card_of_bundled_model(server):
    card = httpx.get(server + "/v1/models/smollm2-135m", timeout=600).json()
    assert card["id"] == FULL_NAME and set(card["aliases"]) == {"smollm2-135m", "smol"}
    assert (card["num_layers"], card["d_model"], card["vocab_size"], card["context_length"]) == (30, 576, 49152, 8192)
    info = httpx.get(server + "/tokenizer_info", timeout=600).json()
    assert info["eos_token"] == "<|im_end|>"


def metric(server, name: str) -> float:
    text = httpx.get(f"{server}/metrics", timeout=600).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_a_client_loop_is_served_from_the_prefix_cache(oai, server, ref64):
    """A client that picks each token itself (a request a token, its prompt the ids so far): from the
    second call on each finds its context kept (/metrics counts hits and tokens saved, and the cache holds
    bytes), and the numbers are the float64 reference's all along."""
    ids = [1] + [504, 6376, 314, 3050, 28, 253, 1391, 282] * 12  # 97 tokens
    hits, saved = metric(server, "logprobe_prefix_cache_hits"), metric(server, "logprobe_prefix_cache_tokens_saved")
    for call in range(12):
        out = oai.completions.create(model=MODEL, prompt=ids, max_tokens=1, logprobs=3, temperature=0,
                                     extra_body={"return_tokens_as_token_ids": True})
        lp = out.choices[0].logprobs
        token = int(lp.tokens[0].split(":")[1])
        if call % 4 == 0:
            row = ref64(ids + [token])[len(ids) - 1]
            assert token == int(np.argmax(row)) and abs(lp.token_logprobs[0] - row[token]) < 2e-4
        ids = ids + [token]
    assert metric(server, "logprobe_prefix_cache_hits") >= hits + 11
    assert metric(server, "logprobe_prefix_cache_tokens_saved") >= saved + 11 * 97
    assert 0 < metric(server, "logprobe_prefix_cache_bytes") <= 256 * 2**20
