"""Holding and running admitted requests. `Held` is a request under its hold, the one wrapper around
every run: `Held.take` takes the hold (`admit`; api/serving/admission.py decides when it fits),
`Held.run` runs the requests to their end while the caller is there and within the time-out,
`Held.stream` streams them, and the hold is given back, with the usage recorded (`release`), however
the request ends (finished, failed, timed out, caller gone, cancelled by shutdown). Each is given what
it needs (the admission, the time-out, the `Call`): nothing is read from an HTTP request."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import StreamingResponse

from ...backend import INTERACTIVE, GenerationOutput, GenerationRequest, run_to_end
from ..errors import BackendLost, backend_error, timed_out
from ..shell.sse import stream_sse


class ClientGone(Exception):
    """The client closed the connection before its answer was ready (logged 499)."""


async def never_gone() -> None:
    """A caller that never leaves by itself (a batch line, a dataset job): cancelling its task stops it."""
    await asyncio.Event().wait()


@dataclass
class Notes:
    """What holding and running a request leave for whoever logs it (the HTTP gate's access log and
    metrics): the hold it ran under, and the tokens it was charged, prompt and completion (a choice
    list's scoring and the request's own run add to one count)."""

    hold: Any = None  # admission.Hold (or the cluster's), None until admitted
    usage: tuple[int, int] | None = None

    def charge(self, prompt: int, completion: int) -> None:
        before = self.usage or (0, 0)
        self.usage = (before[0] + prompt, before[1] + completion)


@dataclass
class Call:
    """Who asks, as far as holding and running a request needs to know: the request id, the key whose
    budget is charged, the priority (`interactive`, or `batch` for a batch line: the pipeline gives it
    to the engine's requests as it builds them), `gone` (returns when the caller has left: an HTTP
    client's disconnect), and the `Notes` written for whoever logs the request."""

    request_id: str
    key_id: str = "anonymous"
    priority: str = INTERACTIVE
    gone: Callable[[], Awaitable[None]] = never_gone
    notes: Notes = field(default_factory=Notes)


def generated_so_far(jobs: list[tuple]) -> int:
    """Tokens generated so far for the requests of the (backend, requests) jobs still running, from the
    backends that can tell (`Backend.generated`: the in-process engine; a Ray Serve replica cannot be
    asked, so behind `--replicas` an abandoned plain request is charged its prompt only, as
    docs/serving.md says)."""
    counts = (backend.generated(rid) for backend, requests in jobs
              for rid in dict.fromkeys(r.request_id for r in requests))
    return sum(count for count in counts if count is not None)


async def run_jobs(jobs: list[tuple]) -> list[list[GenerationOutput]]:
    """Run each (backend, requests) job at the same time, each through its backend's stream drained to its
    end (backend.run_to_end); when one fails or the whole is cancelled, the others are cancelled too
    (their backends abort them), and waited for."""
    tasks = [asyncio.ensure_future(run_to_end(backend, requests)) for backend, requests in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_jobs_while_connected(call: Call, jobs: list[tuple], timeout: float | None,
                                   on_stop: Callable[[int], None] | None = None) -> list[list[GenerationOutput]]:
    """Run each (backend, requests) job, on one or more backends at the same time; if the client
    disconnects first, abort them (the backend drops them before their next step) instead of finishing
    work nobody will read (ClientGone); the same, with 504, when they run past the request time-out. A
    backend that lost the requests (a replica died) answers 503. The task running this cancelled (server
    shutdown, a batch line stopped) aborts them too, and the cancellation goes on as it came. However a
    run is stopped, `on_stop` is first told the tokens generated for it until then."""
    single = len(jobs) == 1  # one backend: its own run, without a wrapping task
    run = asyncio.ensure_future(run_to_end(*jobs[0]) if single else run_jobs(jobs))

    async def stop() -> None:
        if on_stop is not None:
            on_stop(generated_so_far(jobs))
        run.cancel()  # the backend aborts the requests
        await asyncio.gather(run, return_exceptions=True)

    watcher = asyncio.ensure_future(call.gone())
    try:
        await asyncio.wait({run, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled while it ran: the cancellation, not an answer
        watcher.cancel()
        if not run.done():
            await stop()
        raise
    watcher.cancel()
    if not run.done():
        await stop()
        if watcher.done() and not watcher.cancelled():
            raise ClientGone()
        # asyncio.wait returned with neither done: only the time-out ends it so (timeout is a number here)
        raise timed_out(timeout)
    try:
        return [run.result()] if single else run.result()
    except Exception as exc:
        error = backend_error(exc)  # the request's mistake (400) or a lost replica (503), as a stream's
        if error is None or error is exc:
            raise
        raise error from None


async def admit(admission, call: Call, requests: list[GenerationRequest]):
    """Hold the request's tokens (waiting in the queue if need be); see admission.py. A client that
    leaves while its request waits takes it out of the queue at once (ClientGone: logged 499), so it
    blocks nobody behind it. A batch line's call has priority "batch": its hold waits in the batch
    queue (its requests were built with that priority, for the engine's scheduler)."""
    tokens = sum(r.held_tokens for r in requests)
    acquiring = asyncio.ensure_future(admission.acquire(call.key_id, tokens, priority=call.priority))
    watcher = None
    try:
        await asyncio.sleep(0)  # acquire runs to its first wait: a request admitted at once is done here
        if not acquiring.done():
            watcher = asyncio.ensure_future(call.gone())
            await asyncio.wait({acquiring, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not acquiring.done():
                raise ClientGone()
    except BaseException:  # the client left, or this handler was cancelled (shutdown): no hold stays
        if acquiring.done():
            if not acquiring.cancelled() and acquiring.exception() is None:
                admission.release(acquiring.result(), used=0)
        else:
            acquiring.cancel()  # acquire takes the waiter out (and gives back a hold made meanwhile)
            await asyncio.gather(acquiring, return_exceptions=True)
        raise
    finally:
        if watcher is not None:
            watcher.cancel()
    hold = acquiring.result()
    call.notes.hold = hold
    return hold


def release(admission, call: Call, hold, requests: list[GenerationRequest], completion: int,
            lost: bool = False) -> None:
    """The request is over (done, failed, timed out or abandoned): give back its hold, and record its
    usage for the access log and the metrics. The key's budget is charged the prompt tokens (x n) and
    the tokens generated, except for a request the backend lost (its replica died): only what it sent."""
    prompt = sum(r.num_prompt_tokens for r in requests)
    call.notes.charge(prompt, completion)  # a choice list's scoring ran first, under a hold of its own
    used = completion if lost else sum(r.num_prompt_tokens * r.params.n for r in requests) + completion
    admission.release(hold, used=used)


class HeldStream(StreamingResponse):
    """A streamed answer that gives back its hold when it ends, however it ends (finished, client gone,
    cancelled by shutdown), even if its body was never iterated."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
            self.on_close()


class Held:
    """One request under its hold, from admission to release: the one wrapper for every backend (in
    process, Ray Serve replicas, the test double) around a run answered whole (`run`) or streamed
    (`stream`). It holds the request's time-out, its abort (the caller gone, the task cancelled: the
    backend's stream is closed), the mapping of the backend's errors (api/errors.py `backend_error`) and
    its usage: `release` gives the hold back once, however the run ended, charging the prompt and the
    tokens generated until then (only those when the backend lost the request)."""

    def __init__(self, admission, call: Call, requests: list[GenerationRequest], timeout: float | None):
        self.admission, self.call, self.requests, self.timeout = admission, call, requests, timeout
        self.hold = None
        self.completion = 0  # tokens generated so far, charged on release
        self.lost = False  # the backend lost the requests (a replica died)
        self._released = False

    @classmethod
    async def take(cls, admission, call: Call, requests: list[GenerationRequest], timeout: float | None) -> Held:
        """The request's hold, waiting in the queue if need be (`admit`)."""
        held = cls(admission, call, requests, timeout)
        held.hold = await admit(admission, call, requests)
        return held

    def release(self) -> None:
        if not self._released:
            self._released = True
            release(self.admission, self.call, self.hold, self.requests, self.completion, self.lost)

    def _stopped(self, generated: int) -> None:  # client gone, time-out or cancellation: what ran is charged
        self.completion = generated

    async def run(self, jobs: list[tuple]) -> list[list[GenerationOutput]]:
        """Each (backend, requests) job run to its end (their requests are this hold's), and the hold given
        back however that ends."""
        try:
            results = await run_jobs_while_connected(self.call, jobs, self.timeout, self._stopped)
            self.completion = sum(o.num_generated for outputs in results for o in outputs)
            return results
        except BackendLost:
            self.lost = True
            raise
        finally:
            self.release()

    async def stream(self, backend, k: int, format_deltas, final_chunks, **framing) -> StreamingResponse:
        """The streamed answer: SSE chunks as the backend releases tokens; the hold is given back when the
        stream ends however it ends, even if its body is never iterated.

        The status goes out with the first chunk, not before: until the first token is picked an error is
        still the request's own status (an impossible constraint at the first token: 400, a lost replica:
        503), not a 200 followed by an error event. A client that leaves meanwhile aborts the requests.
        `framing`: stream_sse's `error_event` and `done`, for a route whose stream ends its own way."""
        def on_end(end, released, lost):
            self.completion = sum(end.num_generated) if end is not None else released
            self.lost = lost

        gen = stream_sse(backend, self.requests, k, self.call.request_id, format_deltas, final_chunks,
                         timeout=self.timeout, on_end=on_end, **framing)
        first = asyncio.ensure_future(anext(gen))
        watcher = asyncio.ensure_future(self.call.gone())
        try:
            await asyncio.wait({first, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not first.done():
                first.cancel()
                await asyncio.gather(first, return_exceptions=True)
                raise ClientGone()
            head = first.result()  # the first chunk, or the error before it
        except BaseException:
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            await gen.aclose()
            self.release()
            raise
        finally:
            watcher.cancel()

        async def body():
            try:
                yield head
                async for chunk in gen:
                    yield chunk
            finally:  # however the response ends: the backend's stream is closed (aborting what still runs)
                await gen.aclose()

        return HeldStream(body(), self.release, media_type="text/event-stream",
                          headers={"cache-control": "no-cache", "x-accel-buffering": "no", **self.hold.headers})
