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
                     on_end: Callable[[StreamEnd | None, int, bool], None] | None = None) -> AsyncIterator[bytes]:
    """Run requests on the backend and yield SSE bytes: formatted deltas as they come, then
    `final_chunks(end)` and `[DONE]`. A backend error becomes an error event (BackendUnavailable: 503's
    envelope). If the client goes away (this generator is closed or cancelled) or the stream runs past
    `timeout` seconds, the backend's stream is closed, which aborts the requests; a time-out ends with
    an error event. `on_end(end or None, tokens released, lost)` is called once, however the stream ends
    (`lost`: the backend lost the requests, BackendUnavailable)."""
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
        yield b"data: " + error_body(exc.message, exc.type, exc.param, exc.code, request_id) + b"\n\n"
    except BackendUnavailable as exc:
        lost = True
        err = Unavailable(str(exc) or "The model replica serving this request went away; try again.")
        yield b"data: " + error_body(err.message, err.type, err.param, err.code, request_id) + b"\n\n"
    except Exception:
        log.exception("stream failed (%s)", request_id)
        err = InternalError("The server had an error while processing your request.")
        yield b"data: " + error_body(err.message, err.type, err.param, err.code, request_id) + b"\n\n"
    finally:
        await events.aclose()
        if on_end is not None:
            on_end(end, released, lost)
    yield DONE
