"""POST /v1/completions: request checks, the hand-off to the engine, and the response.

Order of work: field types and values (400) -> model (404) -> tokenize -> caps and context (400) ->
engine. Nothing reaches the engine's queue before every check has passed.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

import numpy as np

from ..config import Limits
from ..backend import GenerationOutput, GenerationRequest, SamplingParams
from ..tokens import TextAssembler
from ..output.instruments import asked_ids_top, join_legacy
from ..output.logprobs import TokenNamer, legacy_logprobs
from . import validation as v
from .common import (Parts, ResidualRequest, check_request_caps, check_text_length, instrument_blocks, parse_shared,
                     prompt_logprobs_parts, residual_layers, residual_of, lens_of, unmodified_of)
from .errors import InvalidRequest
from .streaming import sse

COMPLETION_FIELDS = {
    "model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "logprobs",
    "echo", "stop", "seed", "user",
    # logprobe / vLLM extensions
    "top_k", "prompt_logprobs", "vocab_encoding", "output_residual_stream", "output_lens", "add_special_tokens",
    "return_tokens_as_token_ids", "logprob_token_ids", "position_stats", "top_logprobs_p", "logprobs_mode",
    "interventions", "return_unmodified",
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
class CompletionRequest:
    model: str
    prompts: list  # raw: list[str] or list[list[int]]
    params: SamplingParams
    add_special_tokens: bool
    return_tokens_as_token_ids: bool
    stream: bool
    include_usage: bool = False
    vocab_encoding: str | None = None
    residual: ResidualRequest | None = None


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
    shared = parse_shared(body, limits)
    params = SamplingParams(
        max_tokens=v.get_int(body, "max_tokens", 16, ge=0, le=None),  # bounded by the context (caps)
        logprobs=v.get_int(body, "logprobs", None, ge=0, le=limits.max_logprobs),
        echo=v.get_bool(body, "echo", False),
        **shared.sampling,
    )
    if len(prompts) > limits.max_prompts:
        raise InvalidRequest(f"Too many prompts: this server takes at most {limits.max_prompts} prompts "
                             f"in one request (max_prompts), and this one has {len(prompts)}.", "prompt")
    return CompletionRequest(
        model=model,
        prompts=prompts,
        params=params,
        add_special_tokens=v.get_bool(body, "add_special_tokens", True),
        return_tokens_as_token_ids=shared.return_tokens_as_token_ids,
        stream=shared.stream,
        include_usage=shared.include_usage,
        vocab_encoding=shared.vocab_encoding,
        residual=shared.residual,
    )


def tokenize_prompts(backend, req: CompletionRequest) -> list[Prompt]:
    vocab = backend.info.vocab_size
    if isinstance(req.prompts[0], str):
        for text in req.prompts:
            check_text_length(backend, [text], "prompt")
        encoded = backend.tokenizer(req.prompts, add_special_tokens=req.add_special_tokens).input_ids
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


def check_caps(backend, req: CompletionRequest, prompts: list[Prompt], limits: Limits) -> None:
    check_request_caps(backend, [p.token_ids for p in prompts], req.params, req.residual, limits)


def echo_of(backend, prompt: Prompt, added_special: bool) -> tuple[str, list[int]]:
    """The echoed prompt text and each prompt token's offset in it. Special tokens spell their own text
    (`<|endoftext|>`), so the echoed tokens spell the echoed text, as in vLLM, except BOS, which has no
    text (the contract: "no BOS text"): on a token-id prompt every BOS token, on a text prompt the BOS the
    tokenizer added in front (a text prompt is echoed as sent, so a special token written in the text
    keeps its text, and `text[len(prompt):]` is the generated text)."""
    ids = prompt.token_ids
    bos = backend.info.bos_token_id
    added_bos = prompt.text is not None and added_special and backend.info.adds_bos and ids and ids[0] == bos
    asm = TextAssembler(backend.table)
    for i, t in enumerate(ids):
        silent = t == bos and (prompt.text is None or (added_bos and i == 0))
        asm.add(t, special_text=not silent)
    asm.finish()
    text = prompt.text if prompt.text is not None else asm.text
    return text, [min(o, len(text)) for o in asm.offsets]


def build_requests(backend, req: CompletionRequest, prompts: list[Prompt], request_id: str):
    """One GenerationRequest per prompt, plus the echo text and offsets of each prompt."""
    requests, echoes = [], []
    for p in prompts:
        params = req.params
        params = SamplingParams(**{**params.__dict__, "stop_token_ids": backend.info.stop_token_ids,
                                   "residual_layers": residual_layers(backend, req.residual)})
        echo_text, echo_offsets = "", []
        if params.echo:
            echo_text, echo_offsets = echo_of(backend, p, req.add_special_tokens)
        requests.append(GenerationRequest(request_id, p.token_ids, params, len(echo_text)))
        echoes.append((echo_text, echo_offsets))
    return requests, echoes


def format_response(backend, req: CompletionRequest, requests: list[GenerationRequest],
                    outputs: list[GenerationOutput], echoes):
    """The completion as (JSON-ready dict, parts): where the dict holds a placeholder string
    `Parts.MARK`, the bytes yielded by parts[i]() go instead (the prompt_logprobs lists)."""
    params = req.params
    namer = TokenNamer(backend.table.strings, req.return_tokens_as_token_ids)
    choices, parts, completion_tokens = [], Parts(), 0
    for g_index, (request, out, (echo_text, echo_offsets)) in enumerate(zip(requests, outputs, echoes)):
        prompt_ids = np.asarray(request.prompt_ids, dtype=np.int64)
        prompt_part = None
        if params.prompt_logprobs is not None:
            prompt_part = prompt_logprobs_parts(backend, req, prompt_ids, out.prompt_columns)
        for seq in out.choices:
            completion_tokens += seq.num_generated
            text = seq.text
            logprobs = None
            if params.logprobs is not None:
                logprobs = choice_logprobs(namer, params, prompt_ids, out.prompt_columns, seq, echo_offsets,
                                           params.logprobs_mode == "processed")
            mark = None
            if prompt_part is not None:
                mark = parts.add(prompt_part)
            choice = {
                "index": g_index * params.n + seq.index,
                "text": echo_text + text if params.echo else text,
                "logprobs": logprobs,
                "finish_reason": seq.finish_reason,
                "prompt_logprobs": mark,
            }
            if req.residual is not None:
                choice["residual_stream"] = residual_of(backend, req.residual, seq)
            if params.lens_layers:
                choice["logit_lens"] = lens_of(backend, namer, params, prompt_ids, seq)
            if params.return_unmodified:
                choice["unmodified"] = unmodified_of(namer, params, prompt_ids, seq)
            if params.needs_position_columns:
                choice.update(instrument_blocks(params, namer, out.prompt_columns, seq.extras))
            if params.logprobs_mode == "both":
                choice["processed_logprobs"] = None if params.logprobs is None else choice_logprobs(
                    namer, params, prompt_ids, out.prompt_columns, seq, echo_offsets, True)
            choices.append(choice)
    prompt_tokens = sum(r.num_prompt_tokens for r in requests)
    return {
        "id": "cmpl-" + secrets.token_hex(8),
        "object": "text_completion",
        "created": int(time.time()),
        "model": backend.info.name,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }, parts


def choice_logprobs(namer: TokenNamer, params: SamplingParams, prompt_ids: np.ndarray, pc, seq, echo_offsets,
                    processed: bool) -> dict:
    """A choice's `logprobs` object: an echoed prompt's entries, then the generated tokens', whose numbers
    are those of the distribution each was drawn from when `processed` (the raw ones otherwise; a
    prompt position has only the raw distribution). With `logprob_token_ids`, a generated token's
    top_logprobs map holds the token and the asked ids instead of the k likeliest (vLLM)."""
    lps, top_ids, top_lps = seq.logprobs, seq.top_ids, seq.top_logprobs
    if processed and seq.processed_logprobs is not None:  # "both": the raw ones are in seq.logprobs
        lps, top_lps = seq.processed_logprobs, seq.processed_top_logprobs
    if params.logprob_token_ids:
        top_ids, top_lps = asked_ids_top(seq.extras, processed)
    generated = legacy_logprobs(namer, seq.token_ids, lps, top_ids, top_lps, seq.offsets)
    if not params.echo:
        return generated
    k = params.logprobs
    prompt = legacy_logprobs(namer, prompt_ids, pc.logprobs, pc.top_ids[:, :k], pc.top_logprobs[:, :k],
                             echo_offsets, first_is_null=True)
    return join_legacy(prompt, generated)


def stream_formatters(backend, req: CompletionRequest, requests: list[GenerationRequest], echoes):
    """(format_deltas, final_chunks) for `stream: true`: one chunk per choice and step, shaped like a
    completion whose text is the new text and whose logprobs hold the new tokens only; `echo` goes in
    each choice's first chunk, and `text_offset` continues across chunks."""
    params = req.params
    namer = TokenNamer(backend.table.strings, req.return_tokens_as_token_ids)
    head = {"id": "cmpl-" + secrets.token_hex(8), "object": "text_completion", "created": int(time.time()),
            "model": backend.info.name}
    tail = {"usage": None} if req.include_usage else {}
    k = params.logprobs or 0

    def format_deltas(deltas) -> list[bytes]:
        chunks = []
        for d in deltas:
            request = requests[d.group_index]
            echo_text, echo_offsets = echoes[d.group_index]
            text, logprobs = d.text, None
            ids, lps, top_ids, top_lps, offsets = d.token_ids, d.logprobs, d.top_ids, d.top_logprobs, d.offsets
            with_prompt = d.is_first and params.echo
            if with_prompt:
                text = echo_text + text
            if params.logprobs is not None:
                if with_prompt:
                    pc = d.prompt_columns
                    ids = np.concatenate([np.asarray(request.prompt_ids, dtype=np.int64), ids])
                    lps = np.concatenate([pc.logprobs, lps])
                    top_ids = np.concatenate([pc.top_ids[:, :k], top_ids])
                    top_lps = np.concatenate([pc.top_logprobs[:, :k], top_lps])
                    offsets = echo_offsets + offsets
                logprobs = legacy_logprobs(namer, ids, lps, top_ids, top_lps, offsets, first_is_null=with_prompt)
            choice = {"index": d.group_index * params.n + d.seq_index, "text": text, "logprobs": logprobs,
                      "finish_reason": d.finish_reason}
            chunks.append(sse({**head, "choices": [choice], **tail}))
        return chunks

    def final_chunks(end) -> list[bytes]:
        if not req.include_usage:
            return []
        prompt_tokens = sum(end.num_prompt_tokens)
        completion_tokens = sum(end.num_generated)
        return [sse({**head, "choices": [], "usage": {
            "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}})]

    return format_deltas, final_chunks
