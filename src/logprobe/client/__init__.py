"""Helpers for Python users of a logprobe server (numpy in, numpy out; no torch needed).

    from logprobe.client import dense_prompt_logprobs, whole_vocab_of_generated

`dense_prompt_logprobs` turns the dense form of `prompt_logprobs: -1` into a [P, V] array;
`whole_vocab_of_generated` runs the four steps of "Get the whole vocabulary for generated tokens".
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import httpx
import numpy as np

_DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2")}


def dense_prompt_logprobs(prompt_logprobs: list, encoding: str = "float32") -> np.ndarray:
    """[P, V] float32 log probabilities from a choice's dense `prompt_logprobs` (row 0, which no token
    predicts, is NaN)."""
    rows = [np.frombuffer(base64.b64decode(entry["logprobs"]), dtype=_DTYPES[encoding])
            for entry in prompt_logprobs if entry is not None]
    if not rows:
        return np.full((len(prompt_logprobs), 0), np.nan, dtype=np.float32)
    out = np.full((len(prompt_logprobs), rows[0].shape[0]), np.nan, dtype=np.float32)
    out[1:] = np.stack(rows).astype(np.float32)
    return out


class TokenizationMismatch(RuntimeError):
    """The generated text re-tokenized into other tokens than the ones generated."""


@dataclass
class GeneratedVocab:
    text: str  # the generated text
    prompt_tokens: int
    completion_tokens: int
    logprobs: np.ndarray  # [completion_tokens, V]: every token's log probability at each generated position
    token_ids: list[int]  # the generated tokens, as the second request tokenized them


def whole_vocab_of_generated(base_url: str, model: str, prompt: str, max_tokens: int = 16,
                             api_key: str | None = None, timeout: float = 600.0,
                             **sampling) -> GeneratedVocab:
    """Generate, then send prompt + generated text back with `prompt_logprobs: -1` (dense float32) and
    read the generated positions: the seed page's four steps, with its token-count check."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout) as http:
        first = _post(http, {"model": model, "prompt": prompt, "max_tokens": max_tokens, **sampling})
        text = first["choices"][0]["text"]
        start = first["usage"]["prompt_tokens"]
        end = start + first["usage"]["completion_tokens"]
        again = _post(http, {"model": model, "prompt": prompt + text, "max_tokens": 1,
                             "prompt_logprobs": -1, "vocab_encoding": "float32"})
    if again["usage"]["prompt_tokens"] != end:
        raise TokenizationMismatch(
            f"the text split into other tokens: {again['usage']['prompt_tokens']} prompt tokens, "
            f"expected {start} + {end - start}")
    entries = again["choices"][0]["prompt_logprobs"]
    array = dense_prompt_logprobs(entries)
    return GeneratedVocab(text, start, end - start, array[start:end],
                          [entries[p]["token_id"] for p in range(start, end)])


def _post(http: httpx.Client, body: dict) -> dict:
    r = http.post("/v1/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"logprobe answered {r.status_code}: {r.text[:500]}")
    return r.json()
