"""Numpy columns -> the API's log-probability shapes.

The engine hands over arrays (token ids, their log probabilities, top-k ids and values, ranks); this
module builds the JSON-ready lists and maps from them with one vectorised pass per column. Token
strings come from the per-model table (`TokenTable.strings`), never from the tokenizer.
"""

from __future__ import annotations

import numpy as np

NEG_INF_WIRE = -9999.0  # how -inf is written (API.md section 1)


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
    """Rank (1 + number of strictly larger values) of each entry of rows sorted in descending order."""
    out = np.empty(top_lps.shape, dtype=np.int64)
    for r in range(top_lps.shape[0]):
        row = top_lps[r]
        out[r] = np.searchsorted(-row, -row, side="left") + 1
    return out


def prompt_logprobs_maps(namer: TokenNamer, prompt_ids: np.ndarray, lps: np.ndarray, ranks: np.ndarray,
                         top_ids: np.ndarray, top_lps: np.ndarray) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: null at position 0, then {token id: {logprob, rank, decoded_token}}
    holding the prompt's own token and the k likeliest (k or k + 1 entries)."""
    out: list[dict | None] = [None]
    k = top_ids.shape[1]
    own_names = namer.names(prompt_ids)
    own_values = wire_floats(lps).tolist()
    own_ranks = ranks.tolist()
    top_ranks = ranks_of_top(top_lps).tolist() if k else []
    top_names = namer.names(top_ids.reshape(-1)) if k else []
    top_values = wire_floats(top_lps).tolist() if k else []
    flat_ids = top_ids.tolist()
    pids = prompt_ids.tolist()
    for pos in range(1, len(pids)):
        entry = {str(pids[pos]): {"logprob": own_values[pos], "rank": own_ranks[pos],
                                  "decoded_token": own_names[pos]}}
        for j in range(k):
            key = str(flat_ids[pos][j])
            if key not in entry:
                entry[key] = {"logprob": top_values[pos][j], "rank": top_ranks[pos][j],
                              "decoded_token": top_names[pos * k + j]}
        out.append(entry)
    return out
