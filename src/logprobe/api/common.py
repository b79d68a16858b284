"""What completions and chat share: sampling fields, activations' shape, the size caps, and the
response body with streamed parts (the prompt_logprobs lists)."""

from __future__ import annotations

import contextlib
import re
import secrets
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import orjson

from ..config import Limits
from ..backend import PromptColumns, SamplingParams
from ..output.instruments import logprob_token_ids_block, position_stats_block
from ..output.logprobs import TokenNamer, ranks_of_top, wire_floats
from ..output.prompt_json import PromptLogprobsEncoder, iter_dense
from ..output.residual import residual_payload
from . import validation as v
from .errors import ContextLengthExceeded, InvalidRequest
from .interventions import check_interventions, parse_interventions


@contextlib.contextmanager
def inside(name: str):
    """Errors about a key inside the object field `name` name it as `name.key`."""
    try:
        yield
    except InvalidRequest as exc:
        if exc.param and exc.param != name and not exc.param.startswith(name + "."):
            exc.param = f"{name}.{exc.param}"
        elif not exc.param:
            exc.param = name
        raise


@dataclass
class ResidualRequest:
    layers: list[int]
    dtype: str = "float32"
    encoding: str = "base64"


def parse_residual(value) -> ResidualRequest | None:
    """`output_residual_stream`: a list of layer indices, or {"layers", "dtype", "encoding"}."""
    name = "output_residual_stream"
    if value is None:
        return None
    if isinstance(value, list):
        value = {"layers": value}
    if not isinstance(value, dict):
        raise v.type_error(name, "an array of layer indices or an object")
    with inside(name):
        v.check_known_fields(value, {"layers", "dtype", "encoding"}, {})
    layers = value.get("layers")
    if not isinstance(layers, list) or not layers or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in layers):
        raise InvalidRequest(f"Invalid value for '{name}': 'layers' must be a non-empty array of layer "
                             "indices.", name)
    dtype = value.get("dtype", "float32")
    if dtype is None:
        dtype = "float32"
    if not isinstance(dtype, str) or dtype not in ("float32", "float16", "bfloat16"):
        raise InvalidRequest(f"Invalid value for '{name}': 'dtype' must be float32, float16 or bfloat16.",
                             name + ".dtype")
    encoding = value.get("encoding", "base64")
    if encoding is None:
        encoding = "base64"
    if not isinstance(encoding, str) or encoding not in ("base64", "json"):
        raise InvalidRequest(f"Invalid value for '{name}': 'encoding' must be base64 or json.", name + ".encoding")
    return ResidualRequest(list(layers), dtype, encoding)


def parse_lens(value, limits: Limits) -> dict:
    """`output_lens`: a list of layer indices, or {"layers", "top_k"} (SamplingParams keywords)."""
    name = "output_lens"
    if value is None:
        return {}
    if isinstance(value, list):
        value = {"layers": value}
    if not isinstance(value, dict):
        raise v.type_error(name, "an array of layer indices or an object")
    with inside(name):
        v.check_known_fields(value, {"layers", "top_k"}, {})
    layers = value.get("layers")
    if not isinstance(layers, list) or not layers or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in layers):
        raise InvalidRequest(f"Invalid value for '{name}': 'layers' must be a non-empty array of layer "
                             "indices.", name)
    top_k = value.get("top_k", 5)
    if top_k is None:
        top_k = 5
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 0 <= top_k <= limits.max_logprobs:
        raise InvalidRequest(f"Invalid value for '{name}': 'top_k' must be an integer from 0 to "
                             f"{limits.max_logprobs}.", name + ".top_k")
    return {"lens_layers": tuple(layers), "lens_top_k": top_k}


LOGPROBS_MODES = ("raw", "processed", "both")
STREAMED_INSTRUMENTS = ("logprob_token_ids", "position_stats", "top_logprobs_p")


def parse_logprob_token_ids(value, limits: Limits) -> tuple[int, ...]:
    """`logprob_token_ids`: 1..max_logprob_token_ids token ids (repeats allowed); [] is the same as
    leaving it out (vLLM). Ids outside the vocabulary are refused in `check_request_caps`."""
    name = "logprob_token_ids"
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise v.type_error(name, "an array of token ids")
    if len(value) > limits.max_logprob_token_ids:
        raise InvalidRequest(
            f"Too many token ids in 'logprob_token_ids': this server takes at most "
            f"{limits.max_logprob_token_ids} (max_logprob_token_ids), and this request has {len(value)}.", name)
    return tuple(value)


def parse_instruments(body: dict, limits: Limits, stream: bool) -> dict:
    """The instrument fields (docs/api.md, section 2.3) as SamplingParams keyword arguments; only the
    fields a request sets, so that a request without them has exactly the default parameters."""
    out = {}
    ids = parse_logprob_token_ids(body.get("logprob_token_ids"), limits)
    if ids:
        out["logprob_token_ids"] = ids
    if v.get_bool(body, "position_stats", False):
        out["position_stats"] = True
    p = v.get_number(body, "top_logprobs_p", None, gt=0, le=1)
    if p is not None:
        out["top_logprobs_p"] = p
        out["max_top_p_tokens"] = limits.max_top_p_tokens
    mode = v.get_str(body, "logprobs_mode", "raw")
    if mode not in LOGPROBS_MODES:
        raise v.value_error("logprobs_mode", "'raw', 'processed' or 'both'")
    if mode != "raw":
        out["logprobs_mode"] = mode
    if stream:
        for name in STREAMED_INSTRUMENTS:
            if name in out:
                raise InvalidRequest(f"'{name}' does not work with 'stream': true. Send the request without "
                                     "streaming to get it.", name)
        if mode == "both":
            raise InvalidRequest("'logprobs_mode': 'both' does not work with 'stream': true. Send the request "
                                 "without streaming, or use 'processed' (it streams).", "logprobs_mode")
    return out


@dataclass
class SharedFields:
    sampling: dict = field(default_factory=dict)  # SamplingParams keyword arguments
    stream: bool = False
    include_usage: bool = False
    vocab_encoding: str | None = None
    residual: ResidualRequest | None = None
    return_tokens_as_token_ids: bool = False


def parse_shared(body: dict, limits: Limits) -> SharedFields:
    """The fields completions and chat read alike, in OpenAI's order, then the extensions."""
    sampling = dict(
        temperature=v.get_number(body, "temperature", 1.0, ge=0, le=2),
        top_p=v.get_number(body, "top_p", 1.0, gt=0, le=1),
        n=v.get_int(body, "n", 1, ge=1, le=limits.max_n),
        stop=v.get_stop(body, max_items=limits.max_stop),
        seed=v.get_int(body, "seed", None),
        top_k=v.get_int(body, "top_k", -1, ge=-1),
        prompt_logprobs=v.get_int(body, "prompt_logprobs", None, ge=-1, le=limits.max_logprobs),
    )
    stream = v.get_bool(body, "stream", False)
    if stream and sampling["prompt_logprobs"] is not None:
        raise InvalidRequest("'prompt_logprobs' does not work with 'stream': true. Send the request without "
                             "streaming to get prompt log probabilities.", "prompt_logprobs")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise InvalidRequest("'stream_options' is only allowed with 'stream': true.", "stream_options")
        if not isinstance(options, dict):
            raise v.type_error("stream_options", "an object")
        with inside("stream_options"):
            v.check_known_fields(options, {"include_usage", "continuous_usage_stats"}, {})
            include_usage = v.get_bool(options, "include_usage", False)
            v.get_bool(options, "continuous_usage_stats", False)
    vocab_encoding = v.get_str(body, "vocab_encoding")
    if vocab_encoding is not None:
        if vocab_encoding not in ("float32", "float16"):
            raise v.value_error("vocab_encoding", "'float32' or 'float16'")
        if sampling["prompt_logprobs"] != -1:
            raise InvalidRequest("'vocab_encoding' is only used with 'prompt_logprobs': -1.", "vocab_encoding")
    v.get_str(body, "user")
    sampling.update(parse_instruments(body, limits, stream))
    residual = parse_residual(body.get("output_residual_stream"))
    if stream and residual is not None:
        raise InvalidRequest("'output_residual_stream' does not work with 'stream': true. Send the request "
                             "without streaming to get activations.", "output_residual_stream")
    lens = parse_lens(body.get("output_lens"), limits)
    if stream and lens:
        raise InvalidRequest("'output_lens' does not work with 'stream': true. Send the request without "
                             "streaming to get the logit lens.", "output_lens")
    sampling.update(lens)
    sampling.update(parse_interventions(body, limits, stream))
    return SharedFields(
        sampling=sampling, stream=stream, include_usage=include_usage, vocab_encoding=vocab_encoding,
        residual=residual,
        return_tokens_as_token_ids=v.get_bool(body, "return_tokens_as_token_ids", False),
    )


def check_text_length(backend, texts, param: str) -> None:
    """Refuse, before tokenizing, texts that cannot fit the context whatever their tokens: no token
    covers more than the longest token's bytes (+1 for a tokenizer's added space), so a text of more
    than that x context bytes is over. Tokenizing a 10 MB prompt only to refuse it would take seconds."""
    ctx = backend.info.context_length
    per_token = backend.table.max_token_bytes + 1
    size = sum(len(t) for t in texts if isinstance(t, str)) * 4  # UTF-8 bytes, at most 4 a character
    if size <= ctx * per_token:
        return  # the common case, without encoding the text
    size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts if isinstance(t, str))
    if size > ctx * per_token:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {ctx} tokens. However, your text is {size} bytes long, "
            f"which is more than {size // per_token} tokens. Please reduce the {param}.", param)


def check_request_caps(backend, prompts: list[list[int]], params: SamplingParams,
                       residual: ResidualRequest | None, limits: Limits, prompt_param: str = "prompt",
                       max_tokens_param: str = "max_tokens", positions_param: str | None = None) -> None:
    """Every cap of docs/api.md section 8 that depends on the tokenized prompts, and the context length."""
    ctx = backend.info.context_length
    for ids in prompts:
        total = len(ids) + params.max_tokens
        if total > ctx:
            param = prompt_param if len(ids) >= ctx else max_tokens_param
            raise ContextLengthExceeded(
                f"This model's maximum context length is {ctx} tokens. However, you requested {total} "
                f"tokens ({len(ids)} in the prompt, {params.max_tokens} for the completion). "
                "Please reduce the prompt or max_tokens.", param)
    positions = sum(len(ids) for ids in prompts) * params.n
    if params.prompt_logprobs == -1:
        vocab = backend.info.vocab_size
        cap, flag = limits.vocab_positions(vocab, residual is not None)
        if positions > cap:
            with_residual = " with output_residual_stream" if residual is not None else ""
            why = (f"{flag}: {limits.max_vocab_entries:,} positions x vocabulary entries, {cap} positions of this "
                   f"model's {vocab:,} tokens" if flag == "max_vocab_entries" else flag)
            raise InvalidRequest(
                f"'prompt_logprobs': -1 returns the whole vocabulary at every prompt position, so it takes at "
                f"most {cap} prompt tokens x n, summed over the prompts{with_residual} ({why}); this request "
                f"has {positions}. Send fewer or shorter prompts, or a number k instead of -1.",
                "prompt_logprobs")
    if residual is not None:
        num_layers = backend.info.num_layers
        bad = [x for x in residual.layers if not -(num_layers + 1) <= x <= num_layers]
        if bad:
            raise InvalidRequest(f"Invalid value for 'output_residual_stream': layer {bad[0]} does not exist; "
                                 f"this model has layers 0 to {num_layers} (or -{num_layers + 1} to -1).",
                                 "output_residual_stream")
        vectors = sum(len(ids) + params.max_tokens for ids in prompts) * len(residual.layers) * params.n
        if vectors > limits.max_residual_vectors:
            raise InvalidRequest(
                f"Too many residual-stream vectors: positions x layers x n, summed over the prompts, is "
                f"{vectors}, over this server's cap of {limits.max_residual_vectors} (max_residual_vectors). "
                "Ask for fewer layers, positions or choices.", "output_residual_stream")
    if params.logprob_token_ids:
        vocab = backend.info.vocab_size
        bad = [t for t in params.logprob_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"Invalid value for 'logprob_token_ids': token id {bad[0]} is outside the "
                                 f"vocabulary (0 to {vocab - 1}).", "logprob_token_ids")
    if params.lens_layers:
        num_layers = backend.info.num_layers
        bad = [x for x in params.lens_layers if not -(num_layers + 1) <= x <= num_layers]
        if bad:
            raise InvalidRequest(f"Invalid value for 'output_lens': layer {bad[0]} does not exist; this model "
                                 f"has layers 0 to {num_layers} (or -{num_layers + 1} to -1).", "output_lens")
        layers = len({x % (num_layers + 1) for x in params.lens_layers})
        rows = sum(len(ids) + params.max_tokens for ids in prompts) * layers * params.n
        if rows > limits.max_lens_rows:
            raise InvalidRequest(
                f"Too many logit-lens rows: positions x layers x n, summed over the prompts, is {rows}, over "
                f"this server's cap of {limits.max_lens_rows} (max_lens_rows). Each row is a pass of the "
                "head over the whole vocabulary; ask for fewer layers, positions or choices.", "output_lens")
    check_interventions(backend, prompts, params, limits)
    if params.needs_prompt_logits:
        if positions > limits.max_prompt_logprob_positions:
            param = positions_param or positions_field(params)
            raise InvalidRequest(
                f"Too many prompt log-probability positions: prompt tokens x n, summed over the prompts, "
                f"is {positions}, over this server's cap of {limits.max_prompt_logprob_positions} "
                "(max_prompt_logprob_positions).", param)


def positions_field(params: SamplingParams) -> str:
    """The field that made a request compute its prompt positions (named by the positions cap)."""
    if params.prompt_logprobs is not None:
        return "prompt_logprobs"
    if params.echo and params.logprobs is not None:
        return "logprobs"
    if params.logprob_token_ids:
        return "logprob_token_ids"
    return "position_stats" if params.position_stats else "top_logprobs_p"


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
