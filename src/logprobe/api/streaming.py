"""Server-sent events: engine steps -> per-choice deltas -> `data: <chunk>` lines.

After each engine step of a group, `Releaser`s (one per choice) decide, on the engine thread, which new
tokens can go out: a token is released with the text it completes. While stop strings are set, the last
`longest stop - 1` characters are held back (a stop string may still be forming), so the streamed text
and tokens always equal the non-streamed answer. The deltas are handed to the event loop, where the
route's formatter turns them into chunks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import numpy as np
import orjson

from ..engine.request import Sequence, SequenceGroup
from .errors import Timeout, APIError, InternalError, error_body

log = logging.getLogger("logprobe.stream")
DONE = b"data: [DONE]\n\n"


def sse(payload) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


@dataclass
class Delta:
    """What one choice sends in one chunk."""

    group_index: int
    seq_index: int
    is_first: bool
    text: str
    token_ids: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    offsets: list[int]
    finish_reason: str | None


class Releaser:
    def __init__(self, seq: Sequence, k: int, hold_chars: int):
        self.seq = seq
        self.k = k
        self.hold = hold_chars
        self.tokens = 0  # tokens released so far
        self.chars = 0  # characters of the generated text released so far
        self.is_first = True
        self.ended = False  # the chunk with this choice's finish_reason has gone out

    def release(self, group_index: int) -> Delta | None:
        """The choice's next delta, or None when there is nothing new. The delta that carries the
        finish_reason is the last: a choice that ended while the others go on sends nothing more."""
        if self.ended:
            return None
        seq = self.seq
        text = seq.text.text
        start = seq.text.offsets[0] if seq.text.offsets else 0
        if seq.is_finished:
            upto = len(seq.token_ids) if seq.num_kept is None else seq.num_kept
            chars = len(text) if seq.text_end is None else seq.text_end
        else:
            safe = len(text) - self.hold
            upto = self.tokens
            offsets, count = seq.text.offsets, len(seq.token_ids)

            def end_of(i):  # where token i's text ends: where the next token starts
                return (offsets[i + 1] if i + 1 < count else start + len(text)) - start

            while upto < count and end_of(upto) <= safe:
                upto += 1
            chars = end_of(upto - 1) if upto > self.tokens else self.chars
        if upto == self.tokens and chars == self.chars and not seq.is_finished and not self.is_first:
            return None
        ids, lps, top_ids, top_lps = seq.columns(self.k, self.tokens, upto)
        delta = Delta(group_index, seq.index, self.is_first, text[self.chars:chars], ids, lps,
                      top_ids, top_lps, seq.text.offsets[self.tokens:upto],
                      seq.finish_reason.value if seq.is_finished else None)
        self.tokens, self.chars, self.is_first = upto, chars, False
        self.ended = seq.is_finished
        return delta


def attach_releasers(groups: list[SequenceGroup], k: int, loop: asyncio.AbstractEventLoop,
                     queue: asyncio.Queue) -> None:
    """Set each group's on_step to release its choices' new tokens into `queue` (as lists of Delta)."""
    for g_index, group in enumerate(groups):
        stops = group.params.stop
        hold = max((len(s) for s in stops), default=1) - 1
        releasers = [Releaser(seq, k, hold) for seq in group.sequences]

        def on_step(group, releasers=releasers, g_index=g_index):
            deltas = [d for d in (r.release(g_index) for r in releasers) if d is not None]
            if deltas and not loop.is_closed():
                loop.call_soon_threadsafe(queue.put_nowait, deltas)

        group.on_step = on_step


def _consume(fut: asyncio.Future) -> None:
    """Mark a cancelled gather's outcome as seen (asyncio logs it otherwise)."""
    if not fut.cancelled():
        fut.exception()


async def stream_groups(engine, groups: list[SequenceGroup], k: int, request_id: str,
                        format_deltas: Callable[[list[Delta]], list[bytes]],
                        final_chunks: Callable[[], list[bytes]], timeout: float | None = None) -> AsyncIterator[bytes]:
    """Run groups and yield SSE bytes: formatted deltas as they come, then `final_chunks()` and
    `[DONE]`. An engine error becomes an error event. If the client goes away (the generator is
    closed or cancelled), the groups are aborted: the engine drops them before their next step. Past
    `timeout` seconds the groups are aborted and the stream ends with a time-out error event."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    queue: asyncio.Queue = asyncio.Queue()
    attach_releasers(groups, k, loop, queue)
    futures = engine.submit(groups)
    done = asyncio.gather(*futures)
    try:
        while True:
            getter = asyncio.ensure_future(queue.get())
            left = None if deadline is None else max(0.0, deadline - loop.time())
            await asyncio.wait({getter, done}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done() and not done.done():
                getter.cancel()
                raise Timeout(f"The request ran longer than this server's limit of {timeout:g} s "
                              "(request_timeout) and was stopped.")
            if getter.done():
                for chunk in format_deltas(getter.result()):
                    yield chunk
                continue
            getter.cancel()
            while not queue.empty():  # deltas posted before the last future resolved
                for chunk in format_deltas(queue.get_nowait()):
                    yield chunk
            if done.exception() is not None:
                raise done.exception()
            break
        for chunk in final_chunks():
            yield chunk
    except APIError as exc:
        yield b"data: " + error_body(exc.message, exc.type, exc.param, exc.code, request_id) + b"\n\n"
    except Exception:
        log.exception("stream failed (%s)", request_id)
        err = InternalError("The server had an error while processing your request.")
        yield b"data: " + error_body(err.message, err.type, err.param, err.code, request_id) + b"\n\n"
    finally:
        for group in groups:
            if not group.is_finished:
                group.is_aborted = True
        if not done.done():
            done.cancel()
            done.add_done_callback(_consume)
    yield DONE
