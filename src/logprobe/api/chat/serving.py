"""POST /v1/chat/completions: messages through the model's chat template, OpenAI's chat logprobs.

Choices made where the contract is silent (as vLLM does): `max_tokens` / `max_completion_tokens`
default to the rest of the context; the templated prompt is tokenized without adding special tokens
(the template writes them); `prompt_logprobs` is returned at the top level of the response (one chat,
one prompt). The end-of-turn token that stops a reply adds no content and gets no `logprobs.content`
entry (OpenAI's shape), but counts in `usage.completion_tokens`.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, replace

import numpy as np

from ...backend import GenerationOutput, GenerationRequest, SamplingParams
from ...config import Limits
from ...output.instruments import chat_tops_with_token
from ...output.logprobs import TokenNamer, chat_logprobs_content, wire_floats
from ..checks.caps import check_request_caps, check_text_length
from ..checks.interventions import checked_interventions
from ..checks.messages import rendered_ids
from ..checks.sampling import ResidualRequest
from ..checks.steering import check_steering, with_bad_words
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
from .protocol import ChatBody


@dataclass
class ChatRequest:
    model: str
    messages: list[dict]
    params: SamplingParams
    max_tokens: int | None
    top_logprobs: int | None  # None: no logprobs
    stream: bool
    include_usage: bool
    return_tokens_as_token_ids: bool
    vocab_encoding: str | None
    residual: ResidualRequest | None
    max_tokens_field: str = "max_completion_tokens"  # the name the client used
    bad_words: tuple[str, ...] = ()  # tokenized into params.bad_words_ids with the model's tokenizer
    prompt_param: str = "messages"  # the field the conversation came in (/v1/responses: "input")


def parse(body: dict, limits: Limits) -> ChatRequest:
    req = ChatBody.parse(body, limits)
    max_tokens, max_tokens_field = req.max_tokens_given
    params = SamplingParams(max_tokens=max_tokens or 0, logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                            **req.sampling_kwargs(limits))
    return ChatRequest(req.model, req.messages, params, max_tokens, params.logprobs, req.stream, req.include_usage,
                       req.return_tokens_as_token_ids, req.vocab_encoding, req.output_residual_stream,
                       max_tokens_field, req.bad_words)


def tokenize(backend, req: ChatRequest) -> list[int]:
    """The templated conversation's token ids, ending with the assistant's turn opening."""
    check_text_length(backend, [m.get("content") for m in req.messages], req.prompt_param)
    return rendered_ids(backend, req.messages, param=req.prompt_param)[1]


def engine_params(backend, req: ChatRequest, ids: list[int]) -> SamplingParams:
    """What the engine runs with, from the parsed request, the model and the prompt (a new record each
    call): without a max_tokens, the rest of the context; the bad words' token ids, the model's stop
    tokens, the residual layers as indices."""
    max_tokens = req.params.max_tokens if req.max_tokens is not None else max(0, backend.info.context_length - len(ids))
    return replace(with_bad_words(backend, req.params, req.bad_words), max_tokens=max_tokens,
                   stop_token_ids=backend.info.stop_token_ids, residual_layers=residual_layers(backend, req.residual))


def check_caps(backend, req: ChatRequest, ids: list[int], limits: Limits) -> None:
    params = engine_params(backend, req, ids)
    check_request_caps(backend, [ids], params, req.residual, limits, prompt_param=req.prompt_param,
                       max_tokens_param=req.max_tokens_field if req.max_tokens is not None else req.prompt_param)
    if params.min_tokens > params.max_tokens:  # the default max_tokens: what the context leaves
        raise InvalidRequest(f"Invalid value for 'min_tokens': {params.min_tokens} is more than the "
                             f"{params.max_tokens} tokens the context leaves after the messages (the default "
                             "'max_completion_tokens'); 'min_tokens' must be at most that.", "min_tokens")
    check_steering(backend, params)


def build_requests(backend, req: ChatRequest, ids: list[int], request_id: str) -> list[GenerationRequest]:
    params = engine_params(backend, req, ids)
    return [GenerationRequest(request_id, ids, replace(params, interventions=checked_interventions(backend, [ids],
                                                                                                    params)))]


def _ends_with_stop_token(backend, ids, finish_reason) -> bool:
    return finish_reason == "stop" and len(ids) > 0 and int(ids[-1]) in backend.info.stop_token_ids


def content_entries(backend, req: ChatRequest, namer, ids, lps, top_ids, top_lps, finish_reason):
    if _ends_with_stop_token(backend, ids, finish_reason):
        ids, lps, top_ids, top_lps = ids[:-1], lps[:-1], top_ids[:-1], top_lps[:-1]
    return chat_logprobs_content(namer, backend.table.token_bytes, ids, lps, top_ids, top_lps)


def _constraint_logprobs(backend, ids, values, finish_reason) -> list[float]:
    """A masked choice's allowed log mass at each token `logprobs.content` lists (all but an ending
    end-of-turn token)."""
    if _ends_with_stop_token(backend, ids, finish_reason):
        values = values[:-1]
    return wire_floats(values).tolist()


def _listed(backend, seq):
    """The rows of a choice's instrument columns that `logprobs.content` lists (all but an ending
    end-of-turn token)."""
    num = len(seq.token_ids) - _ends_with_stop_token(backend, seq.token_ids, seq.finish_reason)
    return seq.extras.rows(0, num)


def choice_logprobs(backend, req: ChatRequest, namer, seq, processed: bool) -> dict:
    """A choice's `logprobs` ({"content", "refusal"}), with the numbers of the distribution each token
    was drawn from when `processed`; with `logprob_token_ids`, each top_logprobs list holds the token
    and then the asked ids (vLLM) instead of the k likeliest."""
    lps, top_lps = seq.logprobs, seq.top_logprobs
    top_ids = seq.top_ids
    if processed and seq.processed_logprobs is not None:  # "both": the raw ones are in seq.logprobs
        lps, top_lps = seq.processed_logprobs, seq.processed_top_logprobs
        if seq.processed_top_ids is not None:  # steered: the processed distribution's own top-k
            top_ids = seq.processed_top_ids
    content = content_entries(backend, req, namer, seq.token_ids, lps, top_ids, top_lps, seq.finish_reason)
    if req.params.logprob_token_ids:
        listed = _listed(backend, seq)
        values = listed.token_id_logprobs_processed if processed else listed.token_id_logprobs
        content = chat_tops_with_token(content, seq.token_ids, listed.token_ids, values, namer,
                                       backend.table.token_bytes)
    return {"content": content, "refusal": None}


def format_response(backend, req: ChatRequest, ids: list[int], requests: list[GenerationRequest],
                    outputs: list[GenerationOutput]) -> tuple[dict, Parts]:
    """The chat completion as (JSON-ready dict, parts), as completions.format_response."""
    (request,), (out,), parts = requests, outputs, Parts()
    namer = TokenNamer(backend.table.strings, req.return_tokens_as_token_ids)
    params = req.params
    choices, completion_tokens = [], 0
    answers = choice_decision.block(request.params)  # a choice list's answers, each scored
    for seq in out.choices:
        completion_tokens += seq.num_generated
        logprobs = None
        if req.top_logprobs is not None:
            logprobs = choice_logprobs(backend, req, namer, seq, params.logprobs_mode == "processed")
        choice = {"index": seq.index, "message": {"role": "assistant", "content": seq.text},
                  "logprobs": logprobs, "finish_reason": seq.finish_reason}
        if req.residual is not None:
            choice["residual_stream"] = residual_of(backend, req.residual, seq)
        if params.lens_layers:
            choice["logit_lens"] = lens_of(backend, namer, params, request.prompt_ids, seq)
        if params.return_unmodified:
            choice["unmodified"] = unmodified_of(namer, params, request.prompt_ids, seq)
        if params.needs_position_columns:
            choice.update(instrument_blocks(params, namer, out.prompt_columns, _listed(backend, seq)))
        if params.logprobs_mode == "both":
            choice["processed_logprobs"] = (None if req.top_logprobs is None else
                                            choice_logprobs(backend, req, namer, seq, True))
        if seq.constraint_logprobs is not None:
            choice["constraint_logprobs"] = _constraint_logprobs(backend, seq.token_ids, seq.constraint_logprobs,
                                                                 seq.finish_reason)
        if answers is not None:
            choice["choice_logprobs"] = answers
        choices.append(choice)
    # a choice list's scoring passes count as prompt tokens: the key's budget was charged them
    prompt_tokens = out.num_prompt_tokens + choice_decision.scored_tokens(requests)
    body = {"id": "chatcmpl-" + secrets.token_hex(8), "object": "chat.completion", "created": int(time.time()),
           "model": backend.info.name, "choices": choices,
           "usage": usage_block(prompt_tokens, completion_tokens, out.num_cached_tokens)}
    # Always present, null unless asked (the contract; vLLM's clients read it unconditionally)
    body["prompt_logprobs"] = None
    if params.prompt_logprobs is not None:
        prompt_ids = np.asarray(request.prompt_ids, dtype=np.int64)
        body["prompt_logprobs"] = parts.add(prompt_logprobs_parts(backend, req, prompt_ids, out.prompt_columns))
    return body, parts


def stream_formatters(backend, req: ChatRequest, ids: list[int], requests: list[GenerationRequest]):
    """(format_deltas, final_chunks) for chat streaming: `chat.completion.chunk`s whose `delta` carries
    the role first, then content, with `logprobs.content` for exactly the chunk's tokens."""
    namer = TokenNamer(backend.table.strings, req.return_tokens_as_token_ids)
    head = {"id": "chatcmpl-" + secrets.token_hex(8), "object": "chat.completion.chunk",
            "created": int(time.time()), "model": backend.info.name}
    tail = {"usage": None} if req.include_usage else {}
    params = req.params
    answers = choice_decision.block(requests[0].params)  # a choice list's, in each choice's first chunk

    def format_deltas(deltas) -> list[bytes]:
        chunks = []
        for d in deltas:
            if d.is_first:
                first = {"index": d.seq_index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                if answers is not None:
                    first["choice_logprobs"] = answers
                chunks.append(sse({**head, "choices": [first], **tail}))
            if not d.text and not len(d.token_ids) and d.finish_reason is None:
                continue
            logprobs = None
            if req.top_logprobs is not None:
                logprobs = {"content": content_entries(backend, req, namer, d.token_ids, d.logprobs, d.top_ids,
                                                       d.top_logprobs, d.finish_reason), "refusal": None}
            delta = {"content": d.text} if d.text or d.finish_reason is None else {}
            choice = {"index": d.seq_index, "delta": delta, "logprobs": logprobs, "finish_reason": d.finish_reason}
            if params.logprobs_mode == "both":
                choice["processed_logprobs"] = None if d.processed_logprobs is None else {"content": content_entries(
                    backend, req, namer, d.token_ids, d.processed_logprobs, d.processed_top_ids,
                    d.processed_top_logprobs, d.finish_reason), "refusal": None}
            if d.constraint_logprobs is not None:
                choice["constraint_logprobs"] = _constraint_logprobs(backend, d.token_ids, d.constraint_logprobs,
                                                                     d.finish_reason)
            chunks.append(sse({**head, "choices": [choice], **tail}))
        return chunks

    def final_chunks(end) -> list[bytes]:
        if not req.include_usage:
            return []
        prompt = end.num_prompt_tokens[0] + choice_decision.scored_tokens(requests)
        completion = end.num_generated[0]
        return [sse({**head, "choices": [], "usage": usage_block(prompt, completion, cached_of(end))})]

    return format_deltas, final_chunks
