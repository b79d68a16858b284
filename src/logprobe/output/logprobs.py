"""Numpy columns -> the API's log-probability shapes.

The engine hands over arrays (token ids, their log probabilities, top-k ids and values, ranks); this
module builds the JSON-ready lists and maps from them with one vectorised pass per column. Token
strings come from the per-model table (`TokenTable.strings`), never from the tokenizer.
"""

from __future__ import annotations

import numpy as np

NEG_INF_WIRE = -9999.0  # how -inf is written (docs/api.md, section 1)


def wire_floats(values: np.ndarray) -> np.ndarray:
    """float32 values with -inf replaced by the contract's -9999.0, as float64 for exact printing of
    the float32 value."""
    out = np.asarray(values, dtype=np.float32).astype(np.float64)
    out[np.isneginf(out)] = NEG_INF_WIRE
    return out


class TokenNamer:
    """Token id -> the API's token string, as text or as `token_id:N`."""

    def __init__(self, strings: np.ndarray, as_ids: bool):
        self.strings = strings
        self.as_ids = as_ids

    def names(self, ids: np.ndarray) -> list[str]:
        if self.as_ids:
            return [f"token_id:{i}" for i in np.asarray(ids).tolist()]
        return self.strings[np.asarray(ids, dtype=np.int64)].tolist()


def legacy_logprobs(namer: TokenNamer, ids: np.ndarray, lps: np.ndarray, top_ids: np.ndarray,
                    top_lps: np.ndarray, offsets: list[int], first_is_null: bool = False) -> dict:
    """The completions `logprobs` object: tokens, token_logprobs, top_logprobs, text_offset.

    Each top_logprobs map holds the token itself first, then the k likeliest in order of likelihood
    (k or k + 1 entries, as vLLM returns them). With `first_is_null` the first entry (the first
    prompt token, which nothing predicts) is null in token_logprobs and top_logprobs."""
    tokens = namer.names(ids)
    values = wire_floats(lps).tolist()
    k = top_ids.shape[1]
    top_names = namer.names(top_ids.reshape(-1)) if k else []
    top_values = wire_floats(top_lps).reshape(-1).tolist() if k else []
    maps: list[dict | None] = []
    for row, (token, value) in enumerate(zip(tokens, values)):
        entry = {token: value}
        base = row * k
        for j in range(base, base + k):
            entry.setdefault(top_names[j], top_values[j])
        maps.append(entry)
    if first_is_null and tokens:
        values[0] = None
        maps[0] = None
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": maps, "text_offset": list(offsets)}


def ranks_of_top(top_lps: np.ndarray) -> np.ndarray:
    """Rank (1 + number of strictly larger values) of each entry of rows sorted in descending order:
    an entry equal to the one before it shares that one's rank."""
    num, k = top_lps.shape
    if k == 0:
        return np.zeros((num, 0), dtype=np.int64)
    first_of_run = np.ones((num, k), dtype=bool)
    first_of_run[:, 1:] = top_lps[:, 1:] != top_lps[:, :-1]
    candidate = np.where(first_of_run, np.arange(1, k + 1), 0)
    return np.maximum.accumulate(candidate, axis=1)


def chat_logprobs_content(namer: TokenNamer, token_bytes: list[bytes], ids: np.ndarray, lps: np.ndarray,
                          top_ids: np.ndarray, top_lps: np.ndarray) -> list[dict]:
    """Chat `logprobs.content`: per token `{token, logprob, bytes, top_logprobs: [{token, logprob,
    bytes}]}`, the top list holding the k likeliest in order of likelihood (OpenAI's shape)."""
    names = namer.names(ids)
    values = wire_floats(lps).tolist()
    id_list = np.asarray(ids).tolist()
    k = top_ids.shape[1]
    top_names = namer.names(top_ids.reshape(-1)) if k else []
    top_values = wire_floats(top_lps).reshape(-1).tolist() if k else []
    top_id_list = top_ids.reshape(-1).tolist() if k else []
    out = []
    for row, (name, value, tid) in enumerate(zip(names, values, id_list)):
        tops = [{"token": top_names[j], "logprob": top_values[j], "bytes": list(token_bytes[top_id_list[j]])}
                for j in range(row * k, row * k + k)]
        out.append({"token": name, "logprob": value, "bytes": list(token_bytes[tid]), "top_logprobs": tops})
    return out
