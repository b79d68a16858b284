"""POST /v1/completions: request checks, the hand-off to the engine, and the response.

Order of work: field types and values (400) -> model (404) -> tokenize -> caps and context (400) ->
engine. Nothing reaches the engine's queue before every check has passed.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import orjson

from ..config import Limits
from ..engine.request import FinishReason, SamplingParams, SequenceGroup  # noqa: F401
from ..engine.tokenizer import TextAssembler
from ..output.logprobs import TokenNamer, legacy_logprobs, ranks_of_top
from ..output.prompt_json import iter_dense
from . import validation as v
from .errors import ContextLengthExceeded, InvalidRequest

COMPLETION_FIELDS = {
    "model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "logprobs",
    "echo", "stop", "seed", "user",
    # logprobe / vLLM extensions
    "top_k", "prompt_logprobs", "vocab_encoding", "output_residual_stream", "add_special_tokens",
    "return_tokens_as_token_ids",
}
# OpenAI fields logprobe does not implement: accepted only at these neutral values (the last is shown).
UNIMPLEMENTED_FIELDS = {
    "best_of": (None, 1),
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "logit_bias": (None, {}),
    "suffix": ("", None),
}
PROMPT_TYPE = "a string, an array of strings, an array of integers or an array of arrays of integers"


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None  # the original text of a text prompt (None for a token-id prompt)


@dataclass
class ResidualRequest:
    layers: list[int]
    dtype: str = "float32"
    encoding: str = "base64"


@dataclass
class CompletionRequest:
    model: str
    prompts: list  # raw: list[str] or list[list[int]]
    params: SamplingParams
    add_special_tokens: bool
    return_tokens_as_token_ids: bool
    stream: bool
    vocab_encoding: str | None = None
    residual: ResidualRequest | None = None


def parse_residual(value) -> ResidualRequest | None:
    """`output_residual_stream`: a list of layer indices, or {"layers", "dtype", "encoding"}."""
    name = "output_residual_stream"
    if value is None:
        return None
    if isinstance(value, list):
        value = {"layers": value}
    if not isinstance(value, dict):
        raise v.type_error(name, "an array of layer indices or an object")
    v.check_known_fields(value, {"layers", "dtype", "encoding"}, {})
    layers = value.get("layers")
    if not isinstance(layers, list) or not layers or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in layers):
        raise InvalidRequest(f"Invalid value for '{name}': 'layers' must be a non-empty array of layer "
                             "indices.", name)
    dtype = value.get("dtype") or "float32"
    if dtype not in ("float32", "float16", "bfloat16"):
        raise InvalidRequest(f"Invalid value for '{name}': 'dtype' must be float32, float16 or bfloat16.", name)
    encoding = value.get("encoding") or "base64"
    if encoding not in ("base64", "json"):
        raise InvalidRequest(f"Invalid value for '{name}': 'encoding' must be base64 or json.", name)
    return ResidualRequest(list(layers), dtype, encoding)


def parse_prompt(value) -> list:
    """The prompt field as a list of strings or a list of token-id lists."""
    if value is None:
        raise InvalidRequest("Missing required parameter: 'prompt'.", "prompt")
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        if isinstance(value, list):
            raise v.value_error("prompt", "a non-empty prompt")
        raise v.type_error("prompt", PROMPT_TYPE, nullable=False)
    if all(isinstance(x, str) for x in value):
        return value
    if all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return [value]
    if all(isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
           for x in value):
        return value
    raise v.type_error("prompt", PROMPT_TYPE, nullable=False)


def parse_completion(body: dict, limits: Limits) -> CompletionRequest:
    v.check_known_fields(body, COMPLETION_FIELDS, UNIMPLEMENTED_FIELDS)
    model = v.get_str(body, "model", required=True)
    prompts = parse_prompt(body.get("prompt"))
    params = SamplingParams(
        max_tokens=v.get_int(body, "max_tokens", 16, ge=0),
        temperature=v.get_number(body, "temperature", 1.0, ge=0, le=2),
        top_p=v.get_number(body, "top_p", 1.0, gt=0, le=1),
        top_k=v.get_int(body, "top_k", -1, ge=-1),
        seed=v.get_int(body, "seed", None),
        n=v.get_int(body, "n", 1, ge=1, le=limits.max_n),
        stop=v.get_stop(body, max_items=limits.max_stop),
        logprobs=v.get_int(body, "logprobs", None, ge=0, le=limits.max_logprobs),
        echo=v.get_bool(body, "echo", False),
        prompt_logprobs=v.get_int(body, "prompt_logprobs", None, ge=-1, le=limits.max_logprobs),
    )
    stream = v.get_bool(body, "stream", False)
    if stream and params.prompt_logprobs is not None:
        raise InvalidRequest("'prompt_logprobs' does not work with 'stream': true. Send the request without "
                             "streaming to get prompt log probabilities.", "prompt_logprobs")
    vocab_encoding = v.get_str(body, "vocab_encoding")
    if vocab_encoding is not None:
        if vocab_encoding not in ("float32", "float16"):
            raise v.value_error("vocab_encoding", "'float32' or 'float16'")
        if params.prompt_logprobs != -1:
            raise InvalidRequest("'vocab_encoding' is only used with 'prompt_logprobs': -1.", "vocab_encoding")
    residual = parse_residual(body.get("output_residual_stream"))
    if stream:
        raise InvalidRequest("'stream': true is not available yet on this server; send the request "
                             "without it.", "stream")
    if body.get("stream_options") is not None:
        raise InvalidRequest("'stream_options' is only allowed with 'stream': true.", "stream_options")
    v.get_str(body, "user")
    if len(prompts) > limits.max_prompts:
        raise InvalidRequest(f"Too many prompts: this server takes at most {limits.max_prompts} prompts "
                             f"in one request (max_prompts), and this one has {len(prompts)}.", "prompt")
    return CompletionRequest(
        model=model,
        prompts=prompts,
        params=params,
        add_special_tokens=v.get_bool(body, "add_special_tokens", True),
        return_tokens_as_token_ids=v.get_bool(body, "return_tokens_as_token_ids", False),
        stream=stream,
        vocab_encoding=vocab_encoding,
        residual=residual,
    )


def tokenize_prompts(engine, req: CompletionRequest) -> list[Prompt]:
    vocab = engine.info.vocab_size
    if isinstance(req.prompts[0], str):
        encoded = engine.tokenizer(req.prompts, add_special_tokens=req.add_special_tokens).input_ids
        out = [Prompt(list(ids), text) for ids, text in zip(encoded, req.prompts)]
    else:
        out = [Prompt(list(ids), None) for ids in req.prompts]
        for ids in req.prompts:
            bad = [t for t in ids if t < 0 or t >= vocab]
            if bad:
                raise InvalidRequest(f"Invalid value for 'prompt': token id {bad[0]} is outside the "
                                     f"vocabulary (0 to {vocab - 1}).", "prompt")
    for i, p in enumerate(out):
        if not p.token_ids:
            raise InvalidRequest(f"Invalid value for 'prompt': prompt {i} has no tokens (the model adds no "
                                 "BOS token, so an empty text cannot be run).", "prompt")
    return out


def check_caps(engine, req: CompletionRequest, prompts: list[Prompt], limits: Limits) -> None:
    ctx = engine.info.context_length
    params = req.params
    for p in prompts:
        total = len(p.token_ids) + params.max_tokens
        if total > ctx:
            param = "prompt" if len(p.token_ids) >= ctx else "max_tokens"
            raise ContextLengthExceeded(
                f"This model's maximum context length is {ctx} tokens. However, you requested {total} "
                f"tokens ({len(p.token_ids)} in the prompt, {params.max_tokens} for the completion). "
                "Please reduce the prompt or max_tokens.", param)
    positions = sum(len(p.token_ids) for p in prompts) * params.n
    if params.prompt_logprobs == -1:
        cap, flag = limits.max_vocab_positions, "max_vocab_positions"
        if req.residual is not None:
            cap, flag = limits.max_vocab_positions_with_residual, "max_vocab_positions_with_residual"
        if positions > cap:
            with_residual = " with output_residual_stream" if req.residual is not None else ""
            raise InvalidRequest(
                f"'prompt_logprobs': -1 returns the whole vocabulary at every prompt position, so it takes at "
                f"most {cap} prompt tokens x n, summed over the prompts{with_residual} ({flag}); this request "
                f"has {positions}. Send fewer or shorter prompts, or a number k instead of -1.",
                "prompt_logprobs")
    if req.residual is not None:
        num_layers = engine.info.num_layers
        bad = [x for x in req.residual.layers if not -(num_layers + 1) <= x <= num_layers]
        if bad:
            raise InvalidRequest(f"Invalid value for 'output_residual_stream': layer {bad[0]} does not exist; "
                                 f"this model has layers 0 to {num_layers} (or -{num_layers + 1} to -1).",
                                 "output_residual_stream")
        raise InvalidRequest("'output_residual_stream' is not available yet on this server.",
                             "output_residual_stream")
    if params.needs_prompt_logits:
        if positions > limits.max_prompt_logprob_positions:
            param = "prompt_logprobs" if params.prompt_logprobs is not None else "logprobs"
            raise InvalidRequest(
                f"Too many prompt log-probability positions: prompt tokens x n, summed over the prompts, "
                f"is {positions}, over this server's cap of {limits.max_prompt_logprob_positions} "
                "(max_prompt_logprob_positions).", param)


def build_groups(engine, req: CompletionRequest, prompts: list[Prompt], request_id: str):
    """One SequenceGroup per prompt, plus the echo text and offsets of each prompt."""
    groups, echoes = [], []
    for p in prompts:
        params = req.params
        params = SamplingParams(**{**params.__dict__, "stop_token_ids": engine.info.stop_token_ids})
        echo_text, echo_offsets = "", []
        if params.echo:
            asm = TextAssembler(engine.table)
            for t in p.token_ids:
                asm.add(t)
            asm.finish()
            echo_text = p.text if p.text is not None else asm.text
            echo_offsets = [min(o, len(echo_text)) for o in asm.offsets]
        groups.append(SequenceGroup(request_id, p.token_ids, params, engine.table, len(echo_text)))
        echoes.append((echo_text, echo_offsets))
    return groups, echoes


def prompt_logprobs_parts(engine, req: CompletionRequest, group: SequenceGroup):
    """A callable that yields the bytes of one choice's `prompt_logprobs` list."""
    params, pc = req.params, group.prompt_columns
    prompt_ids = np.asarray(group.prompt_ids, dtype=np.int64)
    if params.prompt_logprobs == -1:
        if req.vocab_encoding is not None:
            return lambda: iter_dense(prompt_ids, pc.logprobs, pc.ranks, pc.full, req.vocab_encoding)
        return lambda: engine.prompt_encoder(req.return_tokens_as_token_ids).iter_vocab(pc.full, pc.full_ranks)
    k = params.prompt_logprobs
    top_ids, top_lps = pc.top_ids[:, :k], pc.top_logprobs[:, :k]
    encoder = engine.prompt_encoder(req.return_tokens_as_token_ids)
    return lambda: encoder.iter_topk(prompt_ids, pc.logprobs, pc.ranks, top_ids, top_lps, ranks_of_top(top_lps))


def format_response(engine, req: CompletionRequest, groups: list[SequenceGroup], echoes):
    """The completion as (JSON-ready dict, parts): where the dict holds a placeholder string
    `Parts.MARK`, the bytes yielded by parts[i]() go instead (the prompt_logprobs lists)."""
    params = req.params
    namer = TokenNamer(engine.table.strings, req.return_tokens_as_token_ids)
    choices, parts, completion_tokens = [], Parts(), 0
    for g_index, (group, (echo_text, echo_offsets)) in enumerate(zip(groups, echoes)):
        prompt_ids = np.asarray(group.prompt_ids, dtype=np.int64)
        prompt_part = None
        if params.prompt_logprobs is not None:
            prompt_part = prompt_logprobs_parts(engine, req, group)
        for seq in group.sequences:
            completion_tokens += len(seq.token_ids)
            text = seq.text.text if seq.text_end is None else seq.text.text[: seq.text_end]
            logprobs = None
            if params.logprobs is not None:
                k = params.logprobs
                ids, lps, top_ids, top_lps = seq.columns(k)
                offsets = seq.text.offsets[: len(ids)]
                if params.echo:
                    pc = group.prompt_columns
                    ids = np.concatenate([prompt_ids, ids])
                    lps = np.concatenate([pc.logprobs, lps])
                    top_ids = np.concatenate([pc.top_ids[:, :k], top_ids])
                    top_lps = np.concatenate([pc.top_logprobs[:, :k], top_lps])
                    offsets = echo_offsets + offsets
                logprobs = legacy_logprobs(namer, ids, lps, top_ids, top_lps, offsets,
                                           first_is_null=params.echo)
            mark = None
            if prompt_part is not None:
                mark = parts.add(prompt_part)
            choices.append({
                "index": g_index * params.n + seq.index,
                "text": echo_text + text if params.echo else text,
                "logprobs": logprobs,
                "finish_reason": seq.finish_reason.value,
                "prompt_logprobs": mark,
            })
    prompt_tokens = sum(g.num_prompt_tokens for g in groups)
    return {
        "id": "cmpl-" + secrets.token_hex(8),
        "object": "text_completion",
        "created": int(time.time()),
        "model": engine.info.name,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }, parts


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
