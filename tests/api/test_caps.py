"""The size caps of API.md section 8: each at its limit passes, one over is refused with its param."""

from __future__ import annotations

import orjson
import pytest
from fastapi.testclient import TestClient

from logprobe.api.app import create_app
from logprobe.config import Limits


def status(client, body):
    r = client.post("/v1/completions", json={"model": "tiny", **body})
    if r.status_code == 200 and len(r.content) > 50_000_000:
        return 200, r.content  # a whole-vocabulary answer: its parse is tested elsewhere
    return r.status_code, (r.json().get("error") or {}) if r.status_code != 200 else r.json()


def test_whole_vocabulary_cap_256(fake_client):
    code, body = status(fake_client, {"prompt": [[9] * 128, [9] * 128], "max_tokens": 0, "prompt_logprobs": -1})
    assert code == 200
    assert body.count(b'"rank":') == 2 * 127 * 49152  # every token at every non-first position
    code, err = status(fake_client, {"prompt": [[9] * 128, [9] * 129], "max_tokens": 0, "prompt_logprobs": -1})
    assert code == 400 and err["param"] == "prompt_logprobs"
    assert "256" in err["message"] and "257" in err["message"]
    # n multiplies: 2 x 129 > 256
    code, err = status(fake_client, {"prompt": [9] * 129, "n": 2, "max_tokens": 0, "prompt_logprobs": -1})
    assert code == 400 and err["param"] == "prompt_logprobs" and "258" in err["message"]


def test_whole_vocabulary_cap_with_residual_stream_16(fake_client):
    code, err = status(fake_client, {"prompt": [9] * 17, "max_tokens": 0, "prompt_logprobs": -1,
                                "output_residual_stream": [0, -1]})
    assert code == 400 and err["param"] == "prompt_logprobs" and "16" in err["message"] and "17" in err["message"]
    code, body = status(fake_client, {"prompt": [9] * 16, "max_tokens": 0, "prompt_logprobs": -1,
                                 "output_residual_stream": {"layers": [1], "dtype": "float16"}})
    assert code == 200
    assert orjson.loads(body)["choices"][0]["residual_stream"]["num_positions"] == 16


def test_residual_vectors_cap(fake_client):
    # (100 prompt + 28 generated) x 2 layers x n 2 = 512 per prompt; 128 prompts = 65,536: the cap
    body = {"prompt": [[9] * 100] * 128, "max_tokens": 28, "n": 2, "output_residual_stream": [0, 1]}
    code, err = status(fake_client, {**body, "prompt": [[9] * 100] * 128 + [[9]]})  # + (1 + 28) x 2 x 2
    assert code == 400 and err["param"] == "output_residual_stream"
    assert "65652" in err["message"] and "65536" in err["message"]


def test_residual_vectors_cap_at_its_limit(fake_backend):
    with TestClient(create_app(fake_backend, Limits(max_residual_vectors=60))) as c:
        body = {"prompt": [[9] * 10, [8] * 5], "max_tokens": 0, "n": 2, "output_residual_stream": [0, -1, 1]}
        code, out = status(c, body)  # (10 + 5) x 3 layers x 2 = 90 > 60
        assert code == 400 and out["param"] == "output_residual_stream"
        code, out = status(c, {**body, "output_residual_stream": [0, -1]})  # 15 x 2 x 2 = 60
        assert code == 200 and out["choices"][3]["residual_stream"]["num_positions"] == 5


@pytest.mark.parametrize("value", [[], [1.5], {"layers": [0], "dtype": "int8"}, {"layers": [0], "encoding": "hex"},
                                   {"layers": [0], "other": 1}, "all", [99], [-4]])
def test_residual_stream_shape_is_checked(fake_client, value):
    code, err = status(fake_client, {"prompt": "x", "output_residual_stream": value})
    assert code == 400 and err["param"] in ("output_residual_stream", "output_residual_stream.other",
                                            "output_residual_stream.dtype", "output_residual_stream.encoding")


def test_prompt_logprob_positions_cap(fake_client):
    # tiny's context is 256: 128 prompts x 256 tokens = 32,768 positions, exactly the cap
    code, body = status(fake_client, {"prompt": [[9] * 256] * 128, "max_tokens": 0, "prompt_logprobs": 0})
    assert code == 200 and len(body["choices"]) == 128
    code, err = status(fake_client, {"prompt": [[9] * 256] * 128 + [[9]], "max_tokens": 0, "prompt_logprobs": 0})
    assert code == 400 and err["param"] == "prompt_logprobs" and "32769" in err["message"]
    code, err = status(fake_client, {"prompt": [[9] * 256] * 128 + [[9]], "max_tokens": 0, "echo": True, "logprobs": 0})
    assert code == 400 and err["param"] == "logprobs"


def test_n_and_prompt_count_caps(fake_client):
    assert status(fake_client, {"prompt": "x", "n": 16, "max_tokens": 1})[0] == 200
    assert status(fake_client, {"prompt": "x", "n": 17, "max_tokens": 1})[1]["param"] == "n"
    assert status(fake_client, {"prompt": [[5]] * 256, "max_tokens": 0})[0] == 200
    assert status(fake_client, {"prompt": [[5]] * 257, "max_tokens": 0})[1]["param"] == "prompt"


def test_context_cap_at_limit(fake_client):
    assert status(fake_client, {"prompt": [5] * 250, "max_tokens": 6})[0] == 200
    code, err = status(fake_client, {"prompt": [5] * 251, "max_tokens": 6})
    assert code == 400 and err["code"] == "context_length_exceeded"
    code, err = status(fake_client, {"prompt": [5] * 257, "max_tokens": 0})
    assert code == 400 and err["param"] == "prompt"


def test_logprobs_cap(fake_client):
    assert status(fake_client, {"prompt": "x", "logprobs": 100, "max_tokens": 1})[0] == 200
    assert status(fake_client, {"prompt": "x", "prompt_logprobs": 100, "max_tokens": 0})[0] == 200
    assert status(fake_client, {"prompt": "x", "prompt_logprobs": -2})[1]["message"] == (
        "Invalid value for 'prompt_logprobs': expected a value greater than or equal to -1.")


def test_stream_with_prompt_logprobs_is_refused_first(fake_client):
    code, err = status(fake_client, {"prompt": "x", "prompt_logprobs": 1, "stream": True})
    assert code == 400 and err["param"] == "prompt_logprobs" and "stream" in err["message"]


def test_vocab_encoding_rules(fake_client):
    assert status(fake_client, {"prompt": "x", "prompt_logprobs": 3, "vocab_encoding": "float32"})[1]["param"] == "vocab_encoding"
    assert status(fake_client, {"prompt": "x", "prompt_logprobs": -1, "vocab_encoding": "int8"})[1]["param"] == "vocab_encoding"


def test_caps_are_options_and_reported(fake_backend):
    limits = Limits(max_vocab_positions=4, max_n=2, max_prompts=3, max_logprobs=5, max_body_bytes=1000)
    with TestClient(create_app(fake_backend, limits)) as c:
        card = c.get("/v1/models/tiny").json()["limits"]
        assert (card["max_vocab_positions"], card["max_n"], card["max_prompts"], card["max_logprobs"],
                card["max_body_bytes"]) == (4, 2, 3, 5, 1000)
        assert status(c, {"prompt": [1, 2, 3, 4], "prompt_logprobs": -1, "max_tokens": 0})[0] == 200
        assert status(c, {"prompt": [1, 2, 3, 4, 5], "prompt_logprobs": -1, "max_tokens": 0})[1]["param"] == "prompt_logprobs"
        assert status(c, {"prompt": "x", "n": 3})[1]["message"] == (
            "Invalid value for 'n': expected a value less than or equal to 2.")
        assert status(c, {"prompt": "x", "logprobs": 6})[1]["param"] == "logprobs"
        assert status(c, {"prompt": ["a"] * 4})[1]["param"] == "prompt"
        r = c.post("/v1/completions", content=b'{"model": "tiny", "prompt": "' + b"a" * 1000 + b'"}',
                   headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_whole_vocabulary_cap_counts_entries_for_large_vocabularies(fake_backend):
    """positions x vocabulary (max_vocab_entries) lowers the position cap for a large vocabulary: a model
    with 49,152 tokens and a budget of 3 x 49,152 entries takes 3 positions, with or without the residual
    stream, and its card reports the caps in force for it."""
    vocab = fake_backend.info.vocab_size
    limits = Limits(max_vocab_positions=8, max_vocab_positions_with_residual=2, max_vocab_entries=3 * vocab + 7)
    with TestClient(create_app(fake_backend, limits)) as c:
        card = c.get("/v1/models/tiny").json()["limits"]
        assert (card["max_vocab_positions"], card["max_vocab_entries"]) == (8, 3 * vocab + 7)
        assert (card["vocab_positions"], card["vocab_positions_with_residual"]) == (3, 2)
        assert status(c, {"prompt": [1, 2, 3], "prompt_logprobs": -1, "max_tokens": 0})[0] == 200
        code, err = status(c, {"prompt": [1, 2, 3, 4], "prompt_logprobs": -1, "max_tokens": 0})
        assert code == 400 and err["param"] == "prompt_logprobs" and err["type"] == "invalid_request_error"
        assert "at most 3 prompt tokens x n" in err["message"] and "this request has 4" in err["message"]
        assert "max_vocab_entries" in err["message"] and f"{vocab:,} tokens" in err["message"]
        # the residual cap (2) is the smaller one there, and its message names it
        code, err = status(c, {"prompt": [1, 2, 3], "prompt_logprobs": -1, "max_tokens": 0,
                               "output_residual_stream": [0]})
        assert code == 400 and "(max_vocab_positions_with_residual)" in err["message"]
        # a k instead of -1 is not counted against it
        assert status(c, {"prompt": [1, 2, 3, 4, 5], "prompt_logprobs": 2, "max_tokens": 0})[0] == 200
    # the default budget is 256 positions of Llama 3's vocabulary: 256 for 49,152 tokens, 125 for 262,144
    assert Limits().vocab_positions(49_152) == (256, "max_vocab_positions")
    assert Limits().vocab_positions(128_256) == (256, "max_vocab_positions")
    assert Limits().vocab_positions(262_144) == (125, "max_vocab_entries")
    assert Limits().vocab_positions(262_144, residual=True) == (16, "max_vocab_positions_with_residual")
