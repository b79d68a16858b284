"""POST /v1/responses: OpenAI's Responses API over the chat pipeline (api/chat/serving.py): the input and the
instructions become the chat template's messages, the reply is one output message whose `output_text`
part carries OpenAI's `logprobs` when `include` asks for them; streamed, OpenAI's event sequence
(stream.py: `stream_formatters`).

Choices made where OpenAI's reference is silent or cannot apply (docs/api.md, 3.1): `instructions` is a
system message in front of the input; a `developer` message is read as `system`; `max_output_tokens`
defaults to the rest of the context and takes any value from 1 (OpenAI asks for at least 16; vLLM does
not); a reply cut by `max_output_tokens` (or the context) is `incomplete`, with `incomplete_details.reason`
`max_output_tokens`, as OpenAI's; `usage.input_tokens_details.cached_tokens` counts the input tokens the
prefix cache held; `reasoning_tokens` is 0 (no reasoning items).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from ...backend import GenerationOutput, GenerationRequest, SamplingParams
from ...config import Limits
from ...output.logprobs import TokenNamer
from ..chat import serving as chat
from ..chat.serving import ChatRequest
from ..checks.constraints import compile_constraint
from .protocol import ResponsesBody


@dataclass
class ResponsesRequest(ChatRequest):
    echo: dict = field(default_factory=dict)  # the settings the response object repeats, as OpenAI's does


def parse(body: dict, limits: Limits) -> ResponsesRequest:
    req = ResponsesBody.parse(body, limits)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + req.input
    top = (req.top_logprobs or 0) if req.include else None
    params = SamplingParams(max_tokens=req.max_output_tokens or 0, logprobs=top, temperature=req.temperature,
                            top_p=req.top_p, top_k=req.top_k, seed=req.seed, constraint=req.text)
    text_format = (body.get("text") or {}).get("format") or {"type": "text"}
    echo = {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            "prompt_cache_key": req.prompt_cache_key, "safety_identifier": req.safety_identifier,
            "temperature": req.temperature, "text": {"format": text_format, "verbosity": "medium"},
            "tool_choice": body.get("tool_choice") or "auto", "top_logprobs": req.top_logprobs or 0,
            "top_p": req.top_p, "user": req.user}
    return ResponsesRequest(req.model, messages, params, req.max_output_tokens, top, bool(req.stream),
                            include_usage=False, return_tokens_as_token_ids=False, vocab_encoding=None,
                            residual=None, max_tokens_field="max_output_tokens", prompt_param="input", echo=echo)


tokenize = chat.tokenize
build_requests = chat.build_requests


def check_caps(backend, req: ResponsesRequest, ids: list[int], limits: Limits) -> None:
    compile_constraint(backend, req.params.constraint, "text.format")  # named by this route's field
    chat.check_caps(backend, req, ids, limits)


def new_ids() -> tuple[str, str]:
    """The response's id and its output message's."""
    return "resp_" + secrets.token_hex(12), "msg_" + secrets.token_hex(12)


def response_object(backend, req: ResponsesRequest, response_id: str, created_at: int, status: str,
                    output: list[dict], usage: dict | None) -> dict:
    """OpenAI's `response` object: the output and usage, and the request's settings repeated."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {"id": response_id, "object": "response", "created_at": created_at, "status": status,
            "background": False, "error": None, "incomplete_details": incomplete, "max_tool_calls": None,
            "metadata": {}, "model": backend.info.name, "output": output, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "service_tier": "default", "store": False,
            "tools": [], "truncation": "disabled", "usage": usage, **req.echo}


def usage_of(num_input: int, num_output: int, num_cached: int) -> dict:
    """OpenAI's usage of a response: `input_tokens_details.cached_tokens` counts the input tokens the prefix
    cache held, so no pass computed them."""
    return {"input_tokens": num_input, "input_tokens_details": {"cached_tokens": num_cached}, "output_tokens": num_output,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": num_input + num_output}


def status_of(finish_reason: str | None) -> str:
    """A reply cut by the token limit is incomplete (OpenAI's `incomplete_details.reason`:
    `max_output_tokens`); one that ended itself, or under a constraint, is completed."""
    return "incomplete" if finish_reason == "length" else "completed"


def output_text(text: str, logprobs: list) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def output_message(message_id: str, status: str, content: list[dict]) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "status": status, "content": content}


def format_response(backend, req: ResponsesRequest, ids: list[int], requests: list[GenerationRequest],
                    outputs: list[GenerationOutput]) -> tuple[dict, None]:
    """The response object: one output message of one output_text part."""
    (out,) = outputs
    (seq,) = out.choices
    logprobs = []
    if req.top_logprobs is not None:
        namer = TokenNamer(backend.table.strings, False)
        logprobs = chat.choice_logprobs(backend, req, namer, seq, processed=False)["content"]
    status = status_of(seq.finish_reason)
    response_id, message_id = new_ids()
    output = [output_message(message_id, status, [output_text(seq.text, logprobs)])]
    return response_object(backend, req, response_id, int(time.time()), status, output,
                           usage_of(out.num_prompt_tokens, seq.num_generated, out.num_cached_tokens)), None
