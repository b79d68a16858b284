"""/v1/responses streamed: OpenAI's event sequence, each event as `event: TYPE` and `data: JSON` lines
with a `sequence_number` counting from 0:

    response.created, response.in_progress, response.output_item.added, response.content_part.added,
    response.output_text.delta (one per engine release, with the `logprobs` of its tokens),
    response.output_text.done, response.content_part.done, response.output_item.done,
    response.completed (response.incomplete when max_output_tokens cut the reply)

An error after the first event is an `error` event ({"type": "error", "code", "message", "param"});
the stream ends without `[DONE]`, as OpenAI's does. The delta and done events' `logprobs` have the
shape of OpenAI's event types (`token`, `logprob`, `top_logprobs` of `token` and `logprob`); the
content part and the response object carry the full entries, with `bytes`, as without streaming.
"""

from __future__ import annotations

import time

import orjson

from ...backend import Delta, GenerationRequest, StreamEnd
from ...output.logprobs import TokenNamer
from ..chat import serving as chat
from ..errors import APIError
from ..serving.output_blocks import cached_of
from .serving import ResponsesRequest, new_ids, output_message, output_text, response_object, status_of, usage_of


def event_bytes(payload: dict) -> bytes:
    return b"event: " + payload["type"].encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def short_entries(entries: list[dict]) -> list[dict]:
    """Log probability entries in the shape of the delta event's type (no `bytes`)."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
            for e in entries]


class ResponseEvents:
    """The events of one streamed response: what was sent so far (text, log probabilities, the next
    sequence number), so that the last events repeat the whole reply."""

    def __init__(self, backend, req: ResponsesRequest, num_input: int):
        self.backend, self.req, self.num_input = backend, req, num_input
        self.namer = TokenNamer(backend.table.strings, False)
        self.response_id, self.message_id = new_ids()
        self.created_at = int(time.time())
        self.sequence_number = 0
        self.started = False
        self.text: list[str] = []
        self.logprobs: list[dict] = []
        self.num_output = 0
        self.finish_reason: str | None = None

    def event(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return event_bytes(payload)

    def where(self) -> dict:
        return {"item_id": self.message_id, "output_index": 0, "content_index": 0}

    def opening(self) -> list[bytes]:
        self.started = True
        response = response_object(self.backend, self.req, self.response_id, self.created_at, "in_progress", [], None)
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response),
                self.event("response.output_item.added", output_index=0,
                           item=output_message(self.message_id, "in_progress", [])),
                self.event("response.content_part.added", **self.where(), part=output_text("", []))]

    def format_deltas(self, deltas: list[Delta]) -> list[bytes]:
        chunks = [] if self.started else self.opening()
        for d in deltas:
            self.num_output += len(d.token_ids)
            if d.finish_reason is not None:
                self.finish_reason = d.finish_reason
            entries = []
            if self.req.top_logprobs is not None:
                entries = chat.content_entries(self.backend, self.req, self.namer, d.token_ids, d.logprobs,
                                               d.top_ids, d.top_logprobs, d.finish_reason)
            if not d.text and not entries:
                continue  # an ending end-of-turn token alone: no text, no listed token
            self.text.append(d.text)
            self.logprobs.extend(entries)
            chunks.append(self.event("response.output_text.delta", **self.where(), delta=d.text,
                                     logprobs=short_entries(entries)))
        return chunks

    def final_chunks(self, end: StreamEnd | None) -> list[bytes]:
        chunks = [] if self.started else self.opening()
        text = "".join(self.text)
        status = status_of(self.finish_reason)
        num_input, num_output, num_cached = self.num_input, self.num_output, 0
        if end is not None:
            num_input, num_output, num_cached = end.num_prompt_tokens[0], end.num_generated[0], cached_of(end)
        part = output_text(text, self.logprobs)
        item = output_message(self.message_id, status, [part])
        response = response_object(self.backend, self.req, self.response_id, self.created_at, status, [item],
                                   usage_of(num_input, num_output, num_cached))
        chunks += [self.event("response.output_text.done", **self.where(), text=text,
                              logprobs=short_entries(self.logprobs)),
                   self.event("response.content_part.done", **self.where(), part=part),
                   self.event("response.output_item.done", output_index=0, item=item),
                   self.event(f"response.{status}", response=response)]
        return chunks

    def error_event(self, err: APIError) -> bytes:
        return self.event("error", code=err.code, message=err.message, param=err.param)


def stream_formatters(backend, req: ResponsesRequest, ids: list[int], requests: list[GenerationRequest]):
    """(format_deltas, final_chunks, framing) for pipeline.serve: the events of one response."""
    events = ResponseEvents(backend, req, len(ids))
    return events.format_deltas, events.final_chunks, {"error_event": events.error_event, "done": None}
