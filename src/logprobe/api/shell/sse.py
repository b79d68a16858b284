"""Server-sent events: the backend's per-choice deltas (backend.Delta) -> `data: <chunk>` lines.

The backend decides which tokens can go out after each step (engine/host/streaming.py); the route's formatter
turns each list of deltas into chunks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import orjson

from ...backend import BackendUnavailable, Delta, GenerationRequest, StreamEnd
from ..errors import APIError, InternalError, backend_error, error_body, timed_out

log = logging.getLogger("logprobe.stream")
DONE = b"data: [DONE]\n\n"


def sse(payload) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def stream_sse(backend, requests: list[GenerationRequest], k: int, request_id: str,
                     format_deltas: Callable[[list[Delta]], list[bytes]],
                     final_chunks: Callable[[StreamEnd], list[bytes]], timeout: float | None = None,
                     on_end: Callable[[StreamEnd | None, int, bool], None] | None = None,
                     error_event: Callable[[APIError], bytes] | None = None,
                     done: bytes | None = DONE) -> AsyncIterator[bytes]:
    """Run requests on the backend and yield SSE bytes: formatted deltas as they come, then
    `final_chunks(end)` and `done` (`[DONE]`; None: nothing, as the Responses API ends). An error before
    the first chunk is raised as the APIError its status says (api_error_of: the handler answers it;
    holding.Held.stream waits for the first chunk before it sends a status); after it, it is sent as an
    error event: the error envelope in a `data:` line, or what `error_event(error)` writes. If the client
    goes away (this generator is closed or cancelled) or the stream runs past `timeout` seconds, the
    backend's stream is closed, which aborts the requests. `on_end(end or None, tokens released, lost)` is
    called once, however the stream ends (`lost`: the backend lost the requests, BackendUnavailable)."""
    def error_chunk(err: APIError) -> bytes:
        if error_event is not None:
            return error_event(err)
        return b"data: " + error_body(err.message, err.type, err.param, err.code, request_id) + b"\n\n"

    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    events = backend.stream(requests, k)
    end, released, lost, sent = None, 0, False, False
    try:
        while True:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                event = await asyncio.wait_for(anext(events), left)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise timed_out(timeout) from None
            if isinstance(event, StreamEnd):
                end = event
                continue
            released += sum(len(d.token_ids) for d in event)
            for chunk in format_deltas(event):
                sent = True
                yield chunk
        for chunk in final_chunks(end):
            sent = True
            yield chunk
    except Exception as exc:
        lost = isinstance(exc, BackendUnavailable)
        err = api_error_of(exc, request_id)
        if not sent:
            raise err from None
        yield error_chunk(err)
    finally:
        await events.aclose()
        if on_end is not None:
            on_end(end, released, lost)
    if done is not None:
        yield done


def api_error_of(exc: Exception, request_id: str) -> APIError:
    """The envelope's error for a backend's failure (errors.backend_error, as an answer sent whole gets
    it); anything else 500, without internals, and logged."""
    error = backend_error(exc)
    if error is not None:
        return error
    log.error("stream failed (%s)", request_id, exc_info=exc)
    return InternalError("The server had an error while processing your request.")
