"""POST /v1/completions: request checks, the hand-off to the engine, and the response.

The steps, run in order by pipeline.serve: parse (field types and values, 400; protocol.CompletionBody)
-> model (404) -> tokenize -> caps and context (400) -> build_requests -> the hold and the engine ->
format_response (or stream_formatters). Nothing reaches the engine's queue before every check passed.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field, replace

import numpy as np

from ...backend import GenerationOutput, GenerationRequest, SamplingParams
from ...config import Limits
from ...output.instruments import asked_ids_top, join_legacy
from ...output.logprobs import TokenNamer, legacy_logprobs, wire_floats
from ...tokens import TextAssembler
from ..checks.caps import check_request_caps, check_text_length
from ..checks.interventions import checked_interventions
from ..checks.sampling import ResidualRequest
from ..checks.steering import check_steering, with_bad_words
from ..checks.vocabulary import check_token_ids
from ..errors import InvalidRequest
from ..serving import choice_decision
from ..serving.output_blocks import (
    Parts,
    cached_of,
    instrument_blocks,
    lens_of,
    prompt_logprobs_parts,
    residual_layers,
    residual_of,
    unmodified_of,
    usage_block,
)
from ..shell.sse import sse
from .protocol import CompletionBody


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None  # the original text of a text prompt (None for a token-id prompt)
    echo_text: str = ""  # with `echo`: the prompt's text as echoed, and each token's offset in it
    echo_offsets: list[int] = field(default_factory=list)


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
    bad_words: tuple[str, ...] = ()  # tokenized into params.bad_words_ids with the model's tokenizer


def parse(body: dict, limits: Limits) -> CompletionRequest:
    req = CompletionBody.parse(body, limits)
    params = SamplingParams(max_tokens=req.max_tokens, logprobs=req.logprobs, echo=req.echo,
                            **req.sampling_kwargs(limits))
    return CompletionRequest(
        model=req.model, prompts=req.prompt, params=params, add_special_tokens=req.add_special_tokens,
        return_tokens_as_token_ids=req.return_tokens_as_token_ids, stream=req.stream,
        include_usage=req.include_usage, vocab_encoding=req.vocab_encoding, residual=req.output_residual_stream,
        bad_words=req.bad_words)


def tokenize(backend, req: CompletionRequest) -> list[Prompt]:
    """Each prompt's token ids (and, with `echo`, its echoed text and offsets)."""
    vocab = backend.info.vocab_size
    if isinstance(req.prompts[0], str):
        for text in req.prompts:
            check_text_length(backend, [text], "prompt")
        encoded = backend.tokenizer(req.prompts, add_special_tokens=req.add_special_tokens).input_ids
        out = [Prompt(list(ids), text) for ids, text in zip(encoded, req.prompts)]
    else:
        out = [Prompt(list(ids), None) for ids in req.prompts]
        for ids in req.prompts:
            check_token_ids(ids, vocab, "prompt")
    for i, p in enumerate(out):
        if not p.token_ids:
            raise InvalidRequest(f"Invalid value for 'prompt': prompt {i} has no tokens (the model adds no "
                                 "BOS token, so an empty text cannot be run).", "prompt")
        if req.params.echo:
            p.echo_text, p.echo_offsets = echo_of(backend, p, req.add_special_tokens)
    return out


def engine_params(backend, req: CompletionRequest) -> SamplingParams:
    """What the engine runs with, from the parsed request and the model (a new record each call): the
    bad words' token ids, the model's stop tokens, the residual layers as indices."""
    return replace(with_bad_words(backend, req.params, req.bad_words), stop_token_ids=backend.info.stop_token_ids,
                   residual_layers=residual_layers(backend, req.residual))


def check_caps(backend, req: CompletionRequest, prompts: list[Prompt], limits: Limits) -> None:
    params = engine_params(backend, req)
    check_request_caps(backend, [p.token_ids for p in prompts], params, req.residual, limits)
    check_steering(backend, params)


def echo_of(backend, prompt: Prompt, added_special: bool) -> tuple[str, list[int]]:
    """The echoed prompt text and each prompt token's offset in it. Special tokens spell their own text
    (`<|endoftext|>`), so the echoed tokens spell the echoed text, as in vLLM, except a leading BOS, which
    has no text (the contract: "no BOS text"): the first token of a token-id prompt when it is the BOS,
    on a text prompt the BOS the tokenizer added in front (a text prompt is echoed as sent, so a special
    token written in the text keeps its text, and `text[len(prompt):]` is the generated text). A BOS id
    later in a token-id prompt is a token of the text (SmolLM2's GGUF declares `<|im_start|>`, which
    opens every chat turn, its BOS) and spells its text."""
    ids = prompt.token_ids
    bos = backend.info.bos_token_id
    added_bos = prompt.text is not None and added_special and backend.info.adds_bos and ids and ids[0] == bos
    asm = TextAssembler(backend.table)
    for i, t in enumerate(ids):
        silent = i == 0 and t == bos and (prompt.text is None or added_bos)
        asm.add(t, special_text=not silent)
    asm.finish()
    text = prompt.text if prompt.text is not None else asm.text
    return text, [min(o, len(text)) for o in asm.offsets]


def build_requests(backend, req: CompletionRequest, prompts: list[Prompt], request_id: str) -> list[GenerationRequest]:
    """One GenerationRequest per prompt."""
    params = engine_params(backend, req)
    params = replace(params, interventions=checked_interventions(backend, [p.token_ids for p in prompts], params))
    return [GenerationRequest(request_id, p.token_ids, params, len(p.echo_text)) for p in prompts]


def format_response(backend, req: CompletionRequest, prompts: list[Prompt], requests: list[GenerationRequest],
                    outputs: list[GenerationOutput]):
    """The completion as (JSON-ready dict, parts): where the dict holds a placeholder string
    `Parts.MARK`, the bytes yielded by parts[i]() go instead (the prompt_logprobs lists)."""
    params = req.params
    namer = TokenNamer(backend.table.strings, req.return_tokens_as_token_ids)
    choices, parts, completion_tokens = [], Parts(), 0
    for g_index, (request, out, prompt) in enumerate(zip(requests, outputs, prompts)):
        echo_text, echo_offsets = prompt.echo_text, prompt.echo_offsets
        prompt_ids = np.asarray(request.prompt_ids, dtype=np.int64)
        prompt_part = None
        answers = choice_decision.block(request.params)  # a choice list's answers, each scored
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
            if seq.constraint_logprobs is not None:
                choice["constraint_logprobs"] = wire_floats(seq.constraint_logprobs).tolist()
            if answers is not None:
                choice["choice_logprobs"] = answers
            choices.append(choice)
    # a choice list's scoring passes count as prompt tokens: the key's budget was charged them
    prompt_tokens = sum(r.num_prompt_tokens for r in requests) + choice_decision.scored_tokens(requests)
    return {
        "id": "cmpl-" + secrets.token_hex(8),
        "object": "text_completion",
        "created": int(time.time()),
        "model": backend.info.name,
        "choices": choices,
        "usage": usage_block(prompt_tokens, completion_tokens, sum(out.num_cached_tokens for out in outputs)),
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
        if seq.processed_top_ids is not None:  # steered: the processed distribution's own top-k
            top_ids = seq.processed_top_ids
    if params.logprob_token_ids:
        top_ids, top_lps = asked_ids_top(seq.extras, processed)
    generated = legacy_logprobs(namer, seq.token_ids, lps, top_ids, top_lps, seq.offsets)
    if not params.echo:
        return generated
    k = params.logprobs
    prompt = legacy_logprobs(namer, prompt_ids, pc.logprobs, pc.top_ids[:, :k], pc.top_logprobs[:, :k],
                             echo_offsets, first_is_null=True)
    return join_legacy(prompt, generated)


def stream_formatters(backend, req: CompletionRequest, prompts: list[Prompt], requests: list[GenerationRequest]):
    """(format_deltas, final_chunks) for `stream: true`: one chunk per choice and step, shaped like a
    completion whose text is the new text and whose logprobs hold the new tokens only; `echo` goes in
    each choice's first chunk, and `text_offset` continues across chunks."""
    params = req.params
    namer = TokenNamer(backend.table.strings, req.return_tokens_as_token_ids)
    head = {"id": "cmpl-" + secrets.token_hex(8), "object": "text_completion", "created": int(time.time()),
            "model": backend.info.name}
    tail = {"usage": None} if req.include_usage else {}
    k = params.logprobs or 0
    answers = [choice_decision.block(r.params) for r in requests]  # a choice list's, in each first chunk

    def format_deltas(deltas) -> list[bytes]:
        chunks = []
        for d in deltas:
            request = requests[d.group_index]
            echo_text, echo_offsets = prompts[d.group_index].echo_text, prompts[d.group_index].echo_offsets
            text, logprobs = d.text, None
            with_prompt = d.is_first and params.echo
            if with_prompt:
                text = echo_text + text

            def entries(lps, top_ids, top_lps):
                """The chunk's logprobs object: an echoed prompt's (raw) entries, then its tokens'."""
                ids, offsets = d.token_ids, d.offsets
                if with_prompt:
                    pc = d.prompt_columns
                    ids = np.concatenate([np.asarray(request.prompt_ids, dtype=np.int64), ids])
                    lps = np.concatenate([pc.logprobs, lps])
                    top_ids = np.concatenate([pc.top_ids[:, :k], top_ids])
                    top_lps = np.concatenate([pc.top_logprobs[:, :k], top_lps])
                    offsets = echo_offsets + offsets
                return legacy_logprobs(namer, ids, lps, top_ids, top_lps, offsets, first_is_null=with_prompt)

            if params.logprobs is not None:
                logprobs = entries(d.logprobs, d.top_ids, d.top_logprobs)
            choice = {"index": d.group_index * params.n + d.seq_index, "text": text, "logprobs": logprobs,
                      "finish_reason": d.finish_reason}
            if params.logprobs_mode == "both":
                choice["processed_logprobs"] = None if d.processed_logprobs is None else entries(
                    d.processed_logprobs, d.processed_top_ids, d.processed_top_logprobs)
            if d.constraint_logprobs is not None:
                choice["constraint_logprobs"] = wire_floats(d.constraint_logprobs).tolist()
            if d.is_first and answers[d.group_index] is not None:
                choice["choice_logprobs"] = answers[d.group_index]
            chunks.append(sse({**head, "choices": [choice], **tail}))
        return chunks

    def final_chunks(end) -> list[bytes]:
        if not req.include_usage:
            return []
        prompt_tokens = sum(end.num_prompt_tokens) + choice_decision.scored_tokens(requests)
        completion_tokens = sum(end.num_generated)
        return [sse({**head, "choices": [], "usage": usage_block(prompt_tokens, completion_tokens, cached_of(end))})]

    return format_deltas, final_chunks
