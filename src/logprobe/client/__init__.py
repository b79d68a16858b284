"""Helpers for Python users of a logprobe server (numpy in, numpy out; no torch needed).

    from logprobe.client import dense_prompt_logprobs, whole_vocab_of_generated

`dense_prompt_logprobs` turns the dense form of `prompt_logprobs: -1` into a [P, V] array;
`whole_vocab_of_generated` runs the four steps of "Get the whole vocabulary for generated tokens";
`score`, `score_conversation`, `residual_stream`, `compare` and `compare_spans` call /v1/score and /v1/compare
and return numpy columns; `ScoreClient` (client/http.py) is the asynchronous client of /v1/score that retries,
for many requests.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import httpx
import numpy as np

from .http import ScoreClient, run_sync

_DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2")}


def dense_prompt_logprobs(prompt_logprobs: list, encoding: str | None = None) -> np.ndarray:
    """[P, V] float32 log probabilities from a choice's dense `prompt_logprobs` (row 0, which no token
    predicts, is NaN), whichever `vocab_encoding` the request asked for.

    The width of each number is read from the answer itself: every entry also carries its token's own
    `logprob`, which must be what the array holds at `token_id` (exactly for float32, to float16's
    precision for float16). `encoding` ("float32" or "float16"), when given, is checked the same way.
    An answer that neither width reads consistently raises ValueError instead of returning wrong numbers."""
    if encoding is not None and encoding not in _DTYPES:
        raise ValueError(f"unknown encoding {encoding!r}: use 'float32' or 'float16'")
    entries = [(p, e) for p, e in enumerate(prompt_logprobs) if e is not None]
    if not entries:
        return np.full((len(prompt_logprobs), 0), np.nan, dtype=np.float32)
    raws = []
    for p, e in entries:
        if not isinstance(e, dict) or not isinstance(e.get("logprobs"), str):
            raise ValueError(f"prompt_logprobs[{p}] is not a dense entry (send 'vocab_encoding' with "
                             "'prompt_logprobs': -1)")
        raws.append(base64.b64decode(e["logprobs"]))
    candidates = [encoding] if encoding is not None else list(_DTYPES)
    fits = [name for name in candidates if _reads_as(entries, raws, _DTYPES[name])]
    if not fits:
        tried = encoding or "float32 or float16"
        raise ValueError(f"the dense prompt_logprobs do not read as {tried}: the arrays' values at token_id "
                         "differ from the entries' logprob (or their lengths differ)")
    rows = np.stack([np.frombuffer(raw, dtype=_DTYPES[fits[0]]) for raw in raws]).astype(np.float32)
    out = np.full((len(prompt_logprobs), rows.shape[1]), np.nan, dtype=np.float32)
    out[[p for p, _ in entries]] = rows
    return out


def _reads_as(entries, raws, dtype: np.dtype) -> bool:
    """Whether every raw array reads as `dtype` with the same length and holds each entry's logprob at
    its token_id (float16 rounds: within half a float16 step)."""
    if any(len(raw) % dtype.itemsize for raw in raws) or len({len(raw) for raw in raws}) != 1:
        return False
    width = len(raws[0]) // dtype.itemsize
    for (_, e), raw in zip(entries, raws):
        token, want = e.get("token_id"), e.get("logprob")
        if not isinstance(token, int) or not 0 <= token < width or not isinstance(want, (int, float)):
            return False
        got = float(np.frombuffer(raw, dtype=dtype, count=1, offset=token * dtype.itemsize)[0])
        tol = 0.0 if dtype.itemsize == 4 else 1e-3 * max(1.0, abs(want))
        if np.isneginf(got) and want <= -9999.0:  # -inf is written -9999.0 in JSON
            continue
        if not abs(got - float(want)) <= tol:
            return False
    return True


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


@dataclass
class Score:
    """One scored text: its tokens and their log probabilities (NaN where nothing precedes a token)."""

    tokens: list[str]
    token_ids: np.ndarray
    logprobs: np.ndarray
    ranks: np.ndarray  # 0 where unscored
    text_offset: list[int]
    logprob: float
    mean_logprob: float | None
    perplexity: float | None
    is_greedy: bool
    raw: dict


def score(base_url: str, model: str, text, context=None, add_bos: bool = True, top_logprobs: int | None = None,
          api_key: str | None = None, timeout: float = 600.0, logprob_token_ids: list | None = None) -> list[Score]:
    """POST /v1/score for one text or a list of texts; one `Score` per text, with numpy columns.
    `logprob_token_ids`: ids read at every position, or one list per scored token (docs/api.md, 5.4);
    each Score's `raw["logprob_token_ids"]` holds their numbers."""
    body = {"model": model, "input": text, "add_bos": add_bos}
    if context is not None:
        body["context"] = context
    if top_logprobs is not None:
        body["top_logprobs"] = top_logprobs
    if logprob_token_ids is not None:
        body["logprob_token_ids"] = logprob_token_ids
    return _scores(score_once(base_url, body, api_key, timeout)["data"])


def score_conversation(base_url: str, model: str, messages: list[dict], replies: list[str] | None = None,
                       score_messages: list[int] | None = None, include_end_of_turn: bool = True,
                       api_key: str | None = None, timeout: float = 600.0, **fields) -> list[Score]:
    """POST /v1/score with `messages`: the last assistant turn, the turns `score_messages` names, or each of
    `replies` after the conversation (docs/api.md, 5.3); one `Score` per scored turn. `fields`: any other
    field of /v1/score (top_logprobs, logprob_token_ids, position_stats...)."""
    body = {"model": model, "messages": messages, "include_end_of_turn": include_end_of_turn, **fields}
    if replies is not None:
        body["replies"] = replies
    if score_messages is not None:
        body["score_messages"] = score_messages
    return _scores(score_once(base_url, body, api_key, timeout)["data"])


def _scores(data: list[dict]) -> list[Score]:
    return [Score(d["tokens"], np.asarray(d["token_ids"]),
                  np.array([np.nan if x is None else x for x in d["token_logprobs"]], dtype=np.float64),
                  np.array([0 if x is None else x for x in d["token_ranks"]], dtype=np.int64),
                  d["text_offset"], d["logprob"], d["mean_logprob"], d["perplexity"], d["is_greedy"], d)
            for d in data]


@dataclass
class Comparison:
    """Two models on one text (POST /v1/compare), one row per input token: NaN (top-1: -1) where a token
    has nothing before it, and the wire's 9999.0 / -9999.0 read back as inf / -inf."""

    models: list[str]
    tokens: list[str]
    token_ids: np.ndarray
    kl_pq: np.ndarray  # [T] nats, KL(first || second)
    kl_qp: np.ndarray  # [T] nats
    js: np.ndarray  # [T] nats
    top1: np.ndarray  # [T, 2] each model's likeliest token id
    logprobs: np.ndarray  # [T, 2] each model's log probability of the token
    summary: dict
    raw: dict


def compare(base_url: str, models: list[str], text, context: str | None = None, add_special_tokens: bool = True,
            api_key: str | None = None, timeout: float = 600.0) -> Comparison:
    """POST /v1/compare: per-token KL both ways, Jensen-Shannon, top-1 and log probabilities of two served
    models that share a tokenizer, as numpy columns."""
    body = {"models": list(models), "input": text, "add_special_tokens": add_special_tokens}
    if context is not None:
        body["context"] = context
    out = _request(base_url, "/v1/compare", body, api_key, timeout)
    pos = out["positions"]

    def column(values, fill, width=None):
        empty = [fill] * width if width else fill
        array = np.array([empty if x is None else x for x in values], dtype=np.float64)
        return np.where(np.abs(array) >= 9999.0, np.copysign(np.inf, array), array)

    top1 = np.array([[-1, -1] if x is None else x for x in pos["top1"]], dtype=np.int64).reshape(-1, 2)
    return Comparison(out["models"], out["tokens"], np.asarray(out["token_ids"]), column(pos["kl_pq"], np.nan),
                      column(pos["kl_qp"], np.nan), column(pos["js"], np.nan), top1,
                      column(pos["logprobs"], np.nan, 2).reshape(-1, 2), out["summary"], out)


@dataclass
class SpanComparison:
    """Models of any tokenizers on one text (POST /v1/compare with `align: "text"`), one row per span;
    the wire's -9999.0 read back as -inf."""

    models: list[str]
    spans: list[str]  # each span's text; joined, the input
    logprobs: np.ndarray  # [S, M] each model's log probability of the span (nats)
    difference: np.ndarray  # [S, M - 1] each later model's minus the first's
    spread: np.ndarray  # [S] the largest minus the smallest
    disagreements: list[int]  # up to 10 span indices, the largest spread first
    bits_per_byte: np.ndarray  # [M]
    summary: dict
    raw: dict


def compare_spans(base_url: str, models: list[str], text: str, context: str | None = None,
                  api_key: str | None = None, timeout: float = 600.0) -> SpanComparison:
    """POST /v1/compare with `align: "text"`: each served model's log probability of every span of the
    text where all their tokenizations have a boundary, their differences and bits per byte."""
    body = {"models": list(models), "input": text, "align": "text"}
    if context is not None:
        body["context"] = context
    out = _request(base_url, "/v1/compare", body, api_key, timeout)
    spans, width = out["spans"], len(out["models"])

    def column(values, shape):
        array = np.array(values, dtype=np.float64).reshape(shape)
        return np.where(array <= -9999.0, -np.inf, array)

    return SpanComparison(out["models"], spans["text"], column(spans["logprobs"], (-1, width)),
                          np.array(spans["difference"], dtype=np.float64).reshape(-1, width - 1),
                          np.array(spans["spread"], dtype=np.float64), out["disagreements"],
                          np.array(out["summary"]["bits_per_byte"], dtype=np.float64), out["summary"], out)


def residual_arrays(residual_stream: dict) -> dict[int, np.ndarray]:
    """A `residual_stream` object -> {layer: [num_positions, d_model] float32 array}."""
    shape = (residual_stream["num_positions"], residual_stream["d_model"])
    out = {}
    for key, value in residual_stream["data"].items():
        if residual_stream["encoding"] == "json":
            out[int(key)] = np.asarray(value, dtype=np.float32).reshape(shape)
            continue
        raw = base64.b64decode(value)
        if residual_stream["dtype"] == "bfloat16":
            bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            out[int(key)] = bits.view(np.float32).reshape(shape)
        else:
            out[int(key)] = np.frombuffer(raw, dtype=_DTYPES[residual_stream["dtype"]]).astype(np.float32).reshape(shape)
    return out


def residual_stream(base_url: str, model: str, text, layers: list[int], dtype: str = "float32",
                    add_bos: bool = True, api_key: str | None = None, timeout: float = 600.0) -> dict[int, np.ndarray]:
    """The residual stream of a text's tokens at the asked layers (via /v1/score): {layer: [T, D]}."""
    body = {"model": model, "input": text, "add_bos": add_bos,
            "output_residual_stream": {"layers": layers, "dtype": dtype, "encoding": "base64"}}
    data = score_once(base_url, body, api_key, timeout)["data"][0]
    return residual_arrays(data["residual_stream"])


def score_once(base_url: str, body: dict, api_key: str | None = None, timeout: float = 600.0) -> dict:
    """One /v1/score answer through `ScoreClient` (tried again on 429 and 5xx), from synchronous code."""
    async def ask():
        async with ScoreClient(base_url, api_key, timeout=timeout) as client:
            return await client.score(body)

    return run_sync(ask())


def _request(base_url: str, path: str, body: dict, api_key: str | None, timeout: float) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.post(base_url.rstrip("/") + path, json=body, headers=headers, timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"logprobe answered {r.status_code}: {r.text[:500]}")
    return r.json()
