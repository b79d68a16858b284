"""The parts of a choice beyond its text, from the engine's columns: prompt_logprobs lists (encoded
apart, as `Parts`, and spliced into the body's bytes), instrument blocks, the logit lens, the unmodified
pass and the residual stream."""

from __future__ import annotations

import re
import secrets
import weakref
from collections.abc import Iterator

import numpy as np
import orjson

from ...backend import PromptColumns, SamplingParams
from ...output.instruments import logprob_token_ids_block, position_stats_block
from ...output.logprobs import TokenNamer, ranks_of_top, wire_floats
from ...output.prompt_json import PromptLogprobsEncoder, iter_dense
from ...output.residual import residual_payload
from ..checks.sampling import ResidualRequest

_ENCODERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def prompt_encoder(backend, as_ids: bool = False) -> PromptLogprobsEncoder:
    """The backend's byte encoder of prompt_logprobs maps (its per-model tables, built on first use and
    kept as long as the backend)."""
    encoders = _ENCODERS.setdefault(backend, {})
    if as_ids not in encoders:
        names = ([f"token_id:{i}" for i in range(backend.info.vocab_size)] if as_ids
                 else backend.table.strings.tolist())
        encoders[as_ids] = PromptLogprobsEncoder(names)
    return encoders[as_ids]


def prompt_logprobs_parts(backend, req, prompt_ids: np.ndarray, pc: PromptColumns):
    """A callable that yields the bytes of one choice's `prompt_logprobs` list."""
    params = req.params
    if params.prompt_logprobs == -1:
        if req.vocab_encoding is not None:
            return lambda: iter_dense(prompt_ids, pc.logprobs, pc.ranks, pc.full, req.vocab_encoding)
        return lambda: prompt_encoder(backend, req.return_tokens_as_token_ids).iter_vocab(pc.full, pc.full_ranks)
    k = params.prompt_logprobs
    top_ids, top_lps = pc.top_ids[:, :k], pc.top_logprobs[:, :k]
    encoder = prompt_encoder(backend, req.return_tokens_as_token_ids)
    return lambda: encoder.iter_topk(prompt_ids, pc.logprobs, pc.ranks, top_ids, top_lps, ranks_of_top(top_lps))


class Parts(list):
    """Byte generators that stand in for placeholders in a payload. The placeholder holds a random
    nonce, so that no text a client sent can pass for one."""

    MARK = "\x00logprobe-part-%s-%d\x00"

    def __init__(self):
        super().__init__()
        self.nonce = secrets.token_hex(8)

    def add(self, make_bytes) -> str:
        self.append(make_bytes)
        return self.MARK % (self.nonce, len(self) - 1)


_PART_RE = re.compile(rb'"\\u0000logprobe-part-([0-9a-f]{16})-(\d+)\\u0000"')


def iter_body(payload: dict, parts) -> Iterator[bytes]:
    """The response body: the dict's JSON with each placeholder replaced by its part's bytes."""
    encoded = orjson.dumps(payload)
    pos = 0
    for m in _PART_RE.finditer(encoded):
        if m.group(1).decode() != parts.nonce:
            continue
        yield encoded[pos:m.start()]
        yield from parts[int(m.group(2))]()
        pos = m.end()
    yield encoded[pos:]


def instrument_blocks(params: SamplingParams, namer: TokenNamer, pc: PromptColumns | None, generated) -> dict:
    """A choice's `logprob_token_ids` and `position_stats` blocks, for the fields the request set
    (`generated`: the choice's PositionColumns, the rows of its listed tokens)."""
    out = {}
    prompt = pc.extras if pc is not None else None
    if params.logprob_token_ids:
        out["logprob_token_ids"] = logprob_token_ids_block(prompt, generated)
    if params.position_stats or params.top_logprobs_p is not None:
        out["position_stats"] = position_stats_block(prompt, pc.ranks if pc is not None else None, generated, namer)
    return out


def lens_of(backend, namer: TokenNamer, params: SamplingParams, prompt_ids, seq) -> dict | None:
    """A choice's `logit_lens` block: for each asked layer (as normalized, in the order asked), every
    position's token log probability and rank under that layer's residual stream read through the final
    norm and the head, and its top-k (position 0: null, as in prompt_logprobs)."""
    if seq.lens is None:
        return None
    top = backend.info.num_layers + 1
    ids = [int(t) for t in prompt_ids] + [int(t) for t in seq.token_ids]
    layers = []
    for layer in dict.fromkeys(x % top for x in params.lens_layers):
        cols = seq.lens[layer]
        entry = {"layer": layer, "logprobs": [None] + wire_floats(cols.logprobs[1:len(ids)]).tolist(),
                 "ranks": [None] + cols.ranks[1:len(ids)].tolist()}
        if params.lens_top_k:
            top_ids = cols.top_ids[1:len(ids), :params.lens_top_k]
            entry["top_token_ids"] = [None] + top_ids.tolist()
            entry["top_tokens"] = [None] + [namer.names(row) for row in top_ids]
            entry["top_logprobs"] = [None] + wire_floats(cols.top_logprobs[1:len(ids), :params.lens_top_k]).tolist()
        layers.append(entry)
    return {"token_ids": ids, "tokens": namer.names(np.asarray(ids, dtype=np.int64)), "layers": layers}


def unmodified_of(namer: TokenNamer, params: SamplingParams, prompt_ids, seq) -> dict:
    """A choice's `unmodified` block (return_unmodified): every position's token log probability and
    rank, prompt then generated, from a pass without the request's interventions, with the k likeliest
    tokens there (k: the larger of logprobs and prompt_logprobs; position 0 null), laid out as a layer
    of `logit_lens`."""
    ids = [int(t) for t in prompt_ids] + [int(t) for t in seq.token_ids]
    cols, k = seq.unmodified, max(params.logprobs or 0, params.num_prompt_top)
    out = {"token_ids": ids, "tokens": namer.names(np.asarray(ids, dtype=np.int64)),
           "logprobs": [None] + wire_floats(cols.logprobs[1:len(ids)]).tolist(),
           "ranks": [None] + cols.ranks[1:len(ids)].tolist()}
    if k:
        top_ids = cols.top_ids[1:len(ids), :k]
        out["top_token_ids"] = [None] + top_ids.tolist()
        out["top_tokens"] = [None] + [namer.names(row) for row in top_ids]
        out["top_logprobs"] = [None] + wire_floats(cols.top_logprobs[1:len(ids), :k]).tolist()
    return out


def residual_layers(backend, residual: ResidualRequest | None) -> tuple[int, ...]:
    """The asked layers as indices 0..num_layers (negative ones count from the end)."""
    if residual is None:
        return ()
    top = backend.info.num_layers + 1
    return tuple(sorted({layer % top for layer in residual.layers}))


def residual_of(backend, residual: ResidualRequest | None, seq, rows: slice = slice(None)) -> dict | None:
    if residual is None:
        return None
    return residual_payload(seq.residual, residual.layers, backend.info.num_layers, residual.dtype,
                            residual.encoding, rows)


def usage_block(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """A completion's or a chat completion's `usage`, with OpenAI's `prompt_tokens_details.cached_tokens`:
    the prompt tokens the prefix cache held, so no pass computed them (counted in `prompt_tokens` too)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def cached_of(end) -> int:
    """The cached prompt tokens of a stream's requests, from its `StreamEnd`."""
    return sum(end.num_cached_tokens or ())
