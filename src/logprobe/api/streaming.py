"""Server-sent events: the backend's per-choice deltas (backend.Delta) -> `data: <chunk>` lines.

The backend decides which tokens can go out after each step (engine/host/streaming.py); the route's formatter
turns each list of deltas into chunks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import orjson

from ..backend import BackendUnavailable, Delta, GenerationRequest, StreamEnd
from .errors import APIError, InternalError, Timeout, Unavailable, error_body

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
    `final_chunks(end)` and `done` (`[DONE]`; None: nothing, as the Responses API ends). A backend error
    becomes an error event: the error envelope in a `data:` line (BackendUnavailable: 503's), or what
    `error_event(error)` writes. If the client goes away (this generator is closed or cancelled) or the stream runs past
    `timeout` seconds, the backend's stream is closed, which aborts the requests; a time-out ends with
    an error event. `on_end(end or None, tokens released, lost)` is called once, however the stream ends
    (`lost`: the backend lost the requests, BackendUnavailable)."""
    def error_chunk(err: APIError) -> bytes:
        if error_event is not None:
            return error_event(err)
        return b"data: " + error_body(err.message, err.type, err.param, err.code, request_id) + b"\n\n"

    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    events = backend.stream(requests, k)
    end, released, lost = None, 0, False
    try:
        while True:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                event = await asyncio.wait_for(anext(events), left)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise Timeout(f"The request ran longer than this server's limit of {timeout:g} s "
                              "(request_timeout) and was stopped.") from None
            if isinstance(event, StreamEnd):
                end = event
                continue
            released += sum(len(d.token_ids) for d in event)
            for chunk in format_deltas(event):
                yield chunk
        for chunk in final_chunks(end):
            yield chunk
    except APIError as exc:
        yield error_chunk(exc)
    except BackendUnavailable as exc:
        lost = True
        yield error_chunk(Unavailable(str(exc) or "The model replica serving this request went away; try again."))
    except Exception:
        log.exception("stream failed (%s)", request_id)
        yield error_chunk(InternalError("The server had an error while processing your request."))
    finally:
        await events.aclose()
        if on_end is not None:
            on_end(end, released, lost)
    if done is not None:
        yield done
