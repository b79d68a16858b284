"""prompt_logprobs on the bundled model: k through the openai SDK, the whole vocabulary for 256 tokens,
the dense form, and the client helper's four-step recipe.

Slow: whole-vocabulary rows for 256 positions over HTTP, against float64."""

from __future__ import annotations

import httpx
import numpy as np
import orjson
import pytest

from logprobe.client import dense_prompt_logprobs, whole_vocab_of_generated

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m"
VOCAB = 49152
TEXT_256 = ("The quick brown fox jumps over the lazy dog while the sky turns a deeper shade of blue. " * 30)


def test_prompt_logprobs_k_through_openai_sdk(oai, ref64):
    out = oai.completions.create(model=MODEL, prompt="The sky is", max_tokens=2,
                                 extra_body={"prompt_logprobs": 5})
    plp = out.choices[0].model_extra["prompt_logprobs"]
    ids = [504, 6376, 314]
    assert plp[0] is None and len(plp) == out.usage.prompt_tokens == 3
    ref = ref64(ids)
    for pos in (1, 2):
        entry = plp[pos]
        assert str(ids[pos]) in entry and len(entry) in (5, 6)
        for key, item in entry.items():
            assert abs(item["logprob"] - ref[pos - 1][int(key)]) < 2e-4
        own = entry[str(ids[pos])]
        assert own["rank"] == int((ref[pos - 1] > ref[pos - 1][ids[pos]]).sum()) + 1
        assert own["decoded_token"] == [None, " sky", " is"][pos]


def _prompt_of(server, n_tokens):
    ids = httpx.post(server + "/tokenize", json={"prompt": TEXT_256}, timeout=600).json()["tokens"]
    return ids[:n_tokens]


def test_whole_vocabulary_256_tokens_raw_http(server, ref64):
    ids = _prompt_of(server, 256)
    r = httpx.post(server + "/v1/completions", timeout=600,
                   json={"model": MODEL, "prompt": ids, "max_tokens": 1, "prompt_logprobs": -1})
    assert r.status_code == 200
    data = orjson.loads(r.content)
    del r
    plp = data["choices"][0]["prompt_logprobs"]
    assert data["usage"]["prompt_tokens"] == 256 and len(plp) == 256 and plp[0] is None
    keys = {str(i) for i in range(VOCAB)}
    for pos in range(1, 256):
        assert len(plp[pos]) == VOCAB
    assert set(plp[1]) == keys and set(plp[255]) == keys
    ref = ref64(ids)
    for pos in (1, 128, 255):
        got = np.array([plp[pos][str(i)]["logprob"] for i in range(VOCAB)])
        np.testing.assert_allclose(got, ref[pos - 1], atol=2e-4)
        assert plp[pos][str(ids[pos])]["rank"] >= 1


def test_whole_vocabulary_over_the_cap(server):
    ids = _prompt_of(server, 257)
    r = httpx.post(server + "/v1/completions",
                   json={"model": MODEL, "prompt": ids, "max_tokens": 1, "prompt_logprobs": -1}, timeout=600)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_dense_form_via_sdk_matches_json(oai):
    body = {"prompt_logprobs": -1}
    sparse = oai.completions.create(model=MODEL, prompt="Dense check.", max_tokens=0, extra_body=body)
    dense = oai.completions.create(model=MODEL, prompt="Dense check.", max_tokens=0,
                                   extra_body={**body, "vocab_encoding": "float32"})
    arr = dense_prompt_logprobs(dense.choices[0].model_extra["prompt_logprobs"])
    plp = sparse.choices[0].model_extra["prompt_logprobs"]
    assert arr.shape == (len(plp), VOCAB)
    for pos in range(1, len(plp)):
        json_row = np.array([plp[pos][str(i)]["logprob"] for i in range(VOCAB)], dtype=np.float32)
        assert np.array_equal(arr[pos], json_row)


def test_client_recipe_for_generated_tokens(server, ref64):
    got = whole_vocab_of_generated(server, MODEL, "The sky is", max_tokens=3, temperature=0)
    assert got.logprobs.shape == (got.completion_tokens, VOCAB) == (3, VOCAB)
    ids = [504, 6376, 314] + got.token_ids
    ref = ref64(ids)
    for i in range(3):
        np.testing.assert_allclose(got.logprobs[i], ref[2 + i], atol=2e-4)
        assert got.token_ids[i] == int(np.argmax(ref[2 + i]))
