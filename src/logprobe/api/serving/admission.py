"""The hold (docs/serving.md): admission of checked requests against the server's capacity and each
key's token budget.

A request that has passed every check holds `(prompt tokens + max_tokens) x n`, summed over its
prompts, against two things:

- the server's capacity (`max_tokens_in_flight`): every held token is given back when the request
  ends, fails, times out or its client goes away;
- its key's budget (`tokens_per_minute`, a token bucket that refills continuously): the tokens it did
  not use (max_tokens it did not generate) are given back at the end, as OpenAI's limits do.

Requests that do not fit wait in one bounded FIFO queue. A waiter blocked by the server's capacity
blocks those behind it (so a large request is not starved by small ones); a waiter blocked only by its
own key's budget does not block other keys. 429 `rate_limit_exceeded` with `Retry-After` when the queue
is full, when the wait for the key's budget is known to pass `queue_timeout`, or when it did pass it.

Batch lines (`priority="batch"`, the lines of a /v1/batches job) hold the same tokens against the same
capacity and budget, but wait in a queue of their own behind the interactive requests' and are never
rate limited: no `max_queue`, no `queue_timeout`, no 429; a line waits for its key's budget as long as
that takes, and only leaves the queue when it is admitted or cancelled (or the server drains). They are
admitted only while no interactive request waits for capacity, never with budget an interactive
request of the same key waits for, and together hold at most `batch_share` (3/4) of the capacity (a
single line that needs more runs alone): an interactive request of up to a quarter of the capacity is
admitted at once however full a batch runs, and a larger one takes the capacity batch lines free first.

Everything here runs on the event loop: no locks.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ...backend import BATCH, INTERACTIVE
from ..errors import APIError, InvalidRequest, Unavailable


class RateLimited(APIError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after: float, headers: dict | None = None):
        super().__init__(message, None, headers={**(headers or {}),
                                                 "retry-after": str(max(1, math.ceil(retry_after)))})


def duration(seconds: float) -> str:
    """OpenAI's format for x-ratelimit-reset-*: `850ms`, `2.5s`, `1m30s`."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.0f}s"


class TokenBucket:
    """`per_minute` tokens, refilled continuously at per_minute / 60 a second, never above per_minute."""

    def __init__(self, per_minute: int, now: float):
        self.size = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.size
        self.at = now

    def refill(self, now: float) -> None:
        self.level = min(self.size, self.level + (now - self.at) * self.rate)
        self.at = now

    def wait_for(self, tokens: int, now: float) -> float:
        self.refill(now)
        return 0.0 if self.level >= tokens else (tokens - self.level) / self.rate

    def reset_in(self, now: float) -> float:
        self.refill(now)
        return (self.size - self.level) / self.rate


def budget_headers(bucket: TokenBucket, per_minute: int, now: float) -> dict:
    """OpenAI's x-ratelimit-*-tokens headers of a key's bucket."""
    bucket.refill(now)
    return {"x-ratelimit-limit-tokens": str(per_minute),
            "x-ratelimit-remaining-tokens": str(int(bucket.level)),
            "x-ratelimit-reset-tokens": duration(bucket.reset_in(now))}


def never_fits_budget(tokens: int, per_minute: int, headers: dict) -> RateLimited:
    return RateLimited(
        f"This request needs {tokens} tokens, more than your key's budget of {per_minute} "
        "tokens per minute (tokens_per_minute); it can never run. Reduce max_tokens, n or the prompts.",
        60, headers)


def budget_wait_too_long(tokens: int, level: float, per_minute: int, wait: float, headers: dict) -> RateLimited:
    return RateLimited(
        f"Rate limit reached for your key: {tokens} tokens requested, {int(level)} of "
        f"{per_minute} tokens per minute left. Try again in {duration(wait)}.", wait, headers)


def waited_too_long(tokens: int, queue_timeout: float, headers: dict) -> RateLimited:
    return RateLimited(f"The server is busy: this request waited {queue_timeout:g} s for its "
                       f"{tokens} tokens (queue_timeout). Try again shortly.", 1, headers)


def over_capacity(tokens: int, capacity: int) -> InvalidRequest:
    return InvalidRequest(
        f"This request needs {tokens} tokens ((prompt tokens + max_tokens) x n, summed over the prompts), "
        f"more than this server ever holds at once ({capacity}, max_tokens_in_flight). "
        "Reduce max_tokens, n or the prompts.", "max_tokens")


BATCH_WAIT_S = 10 * 365 * 86400.0  # "no time-out" where an API takes seconds (cluster/state.py's take)


def batch_never_fits_budget(tokens: int, per_minute: int) -> InvalidRequest:
    """A batch line that needs more than its key's budget for a minute could never run: an error line
    (400), not a wait without end and not a 429."""
    return InvalidRequest(
        f"This request needs {tokens} tokens, more than your key's budget of {per_minute} tokens per "
        "minute (tokens_per_minute); it can never run. Reduce max_tokens, n or the prompts.", "max_tokens")


@dataclass(eq=False)
class Hold:
    key: str
    tokens: int
    queued_at: float
    admitted_at: float | None = None
    released: bool = False
    headers: dict = field(default_factory=dict)
    priority: str = INTERACTIVE

    @property
    def queue_seconds(self) -> float:
        return 0.0 if self.admitted_at is None else self.admitted_at - self.queued_at


@dataclass(eq=False)
class _Waiter:
    hold: Hold
    future: asyncio.Future


@runtime_checkable
class AdmissionControl(Protocol):
    """What the API asks of an admission: `Admission` below in one process, cluster/state.py's
    `SharedAdmission` at the ingress of an application of replicas.

    - `acquire`: wait until a request's tokens fit and hold them (the errors `Admission.acquire` names);
    - `release`: the request is over, having used `used` of its held tokens; idempotent;
    - `drain`: admit nothing more (503), for a shutdown;
    - `held`, `running`, `queue_depth`, `capacity`, `draining`: /health's and /metrics' numbers;
    - `on_queue_time`: called with the seconds an admitted interactive request waited (metrics)."""

    capacity: int
    held: int
    running: int
    draining: bool
    on_queue_time: Callable[[float], None] | None

    @property
    def queue_depth(self) -> int: ...

    async def acquire(self, key: str, tokens: int, priority: str = INTERACTIVE) -> Hold: ...

    def release(self, hold: Hold, used: int) -> None: ...

    def drain(self) -> None: ...


class Admission:
    def __init__(self, capacity: int, tokens_per_minute: int = 0, max_queue: int = 256,
                 queue_timeout: float = 30.0, clock=time.monotonic, batch_share: float = 0.75):
        self.capacity = capacity
        self.tokens_per_minute = tokens_per_minute
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.clock = clock
        # batch holds together take at most this much of the capacity (unless one line alone needs
        # more): the rest is kept for interactive requests, admitted at once however full a batch runs
        self.batch_capacity = int(capacity * batch_share)
        self.held = 0  # tokens held by admitted requests
        self.batch_held = 0  # ... of them, by batch lines
        self.running = 0  # admitted requests not yet released
        self.draining = False
        self._buckets: dict[str, TokenBucket] = {}
        self._waiters: collections.deque[_Waiter] = collections.deque()  # interactive requests
        self._batch_waiters: collections.deque[_Waiter] = collections.deque()  # batch lines
        self._timer: asyncio.TimerHandle | None = None
        self.on_queue_time = None  # called with seconds waited, for every admitted interactive request

    @property
    def queue_depth(self) -> int:
        """Interactive requests waiting (batch lines are not refused for a full queue, nor counted here)."""
        return len(self._waiters)

    @property
    def batch_queue_depth(self) -> int:
        return len(self._batch_waiters)

    def _bucket(self, key: str) -> TokenBucket | None:
        if not self.tokens_per_minute:
            return None
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(self.tokens_per_minute, self.clock())
        return bucket

    def _budget_headers(self, key: str) -> dict:
        bucket = self._bucket(key)
        if bucket is None:
            return {}
        return budget_headers(bucket, self.tokens_per_minute, self.clock())

    async def acquire(self, key: str, tokens: int, priority: str = INTERACTIVE) -> Hold:
        """Wait until `tokens` fit and hold them. Raises Unavailable (draining), InvalidRequest (can never
        fit the server), RateLimited (queue full, budget or wait too long). Cancelling the caller while
        it waits takes it out of the queue. A batch line (`priority="batch"`) is never rate limited: it
        waits for its key's budget and for capacity however long that takes (InvalidRequest if it could
        never fit its key's budget)."""
        if self.draining:
            raise Unavailable("The server is shutting down and takes no new requests.")
        if tokens > self.capacity:
            raise over_capacity(tokens, self.capacity)
        if priority == BATCH:
            return await self._acquire_batch(key, tokens)
        now = self.clock()
        bucket = self._bucket(key)
        if bucket is not None:
            if tokens > self.tokens_per_minute:
                raise never_fits_budget(tokens, self.tokens_per_minute, self._budget_headers(key))
            wait = bucket.wait_for(tokens, now)
            if wait > self.queue_timeout:
                raise budget_wait_too_long(tokens, bucket.level, self.tokens_per_minute, wait,
                                           self._budget_headers(key))
        hold = Hold(key, tokens, now)
        waiter = _Waiter(hold, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self._pump()
        if waiter.future.done():
            return waiter.future.result()
        if len(self._waiters) > self.max_queue:
            self._waiters.remove(waiter)
            raise RateLimited(f"The server is busy: {self.max_queue} requests are already waiting (max_queue). "
                              "Try again shortly.", 1, self._budget_headers(key))
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), self.queue_timeout)
        except asyncio.TimeoutError:
            self._drop(waiter)
            raise waited_too_long(tokens, self.queue_timeout, self._budget_headers(key)) from None
        except asyncio.CancelledError:
            self._drop(waiter)
            raise

    async def _acquire_batch(self, key: str, tokens: int) -> Hold:
        if self.tokens_per_minute and tokens > self.tokens_per_minute:
            raise batch_never_fits_budget(tokens, self.tokens_per_minute)
        waiter = _Waiter(Hold(key, tokens, self.clock(), priority=BATCH), asyncio.get_running_loop().create_future())
        self._batch_waiters.append(waiter)
        self._pump()
        try:
            return await asyncio.shield(waiter.future)
        except asyncio.CancelledError:
            self._drop(waiter)
            raise

    def _drop(self, waiter: _Waiter) -> None:
        """Take a waiter out; if it was admitted in the meantime, give its hold back."""
        queue = self._batch_waiters if waiter.hold.priority == BATCH else self._waiters
        if waiter in queue:
            queue.remove(waiter)
            self._pump()  # it may have blocked those behind it
        elif waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
            self.release(waiter.future.result(), used=0)

    def _pump(self) -> None:
        """Admit waiters while they fit: interactive requests first, in order; then batch lines, in
        order, unless an interactive request waits for capacity (it takes what frees first), and not a
        key's batch lines while an interactive request of that key waits for its budget. A waiter
        blocked by capacity blocks those of its class behind it; one blocked only by its key's budget
        does not block other keys."""
        now = self.clock()
        next_refill = math.inf
        budget_blocked: set[str] = set()  # keys whose budget an earlier waiter waits for
        for waiter in list(self._waiters):
            wait = self._budget_wait(waiter.hold, now)
            if wait > 0:
                next_refill = min(next_refill, wait)
                budget_blocked.add(waiter.hold.key)
                continue
            if self.held + waiter.hold.tokens > self.capacity:
                break
            self._admit(waiter, self._waiters, now)
        else:  # no interactive request waits for capacity
            for waiter in list(self._batch_waiters):
                hold = waiter.hold
                if hold.key in budget_blocked:
                    continue
                wait = self._budget_wait(hold, now)
                if wait > 0:  # a batch's lines take its key's budget in order
                    next_refill = min(next_refill, wait)
                    budget_blocked.add(hold.key)
                    continue
                if self.held + hold.tokens > self.capacity or (
                        self.batch_held and self.batch_held + hold.tokens > self.batch_capacity):
                    break
                self._admit(waiter, self._batch_waiters, now)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if next_refill < math.inf:
            self._timer = asyncio.get_running_loop().call_later(next_refill + 1e-3, self._pump)

    def _budget_wait(self, hold: Hold, now: float) -> float:
        bucket = self._bucket(hold.key)
        return 0.0 if bucket is None else bucket.wait_for(hold.tokens, now)

    def _admit(self, waiter: _Waiter, queue: collections.deque, now: float) -> None:
        hold = waiter.hold
        queue.remove(waiter)
        bucket = self._bucket(hold.key)
        if bucket is not None:
            bucket.level -= hold.tokens
        self.held += hold.tokens
        if hold.priority == BATCH:
            self.batch_held += hold.tokens
        self.running += 1
        hold.admitted_at = now
        hold.headers = self._budget_headers(hold.key)
        if self.on_queue_time is not None and hold.priority != BATCH:
            self.on_queue_time(hold.queue_seconds)
        waiter.future.set_result(hold)

    def release(self, hold: Hold, used: int) -> None:
        """The request is over: give back all its held tokens to the server, and those it did not use
        (`tokens - used`) to its key's budget. Idempotent."""
        if hold.released:
            return
        hold.released = True
        self.held -= hold.tokens
        if hold.priority == BATCH:
            self.batch_held -= hold.tokens
        self.running -= 1
        bucket = self._bucket(hold.key)
        if bucket is not None:
            bucket.refill(self.clock())
            bucket.level = min(bucket.size, bucket.level + max(0, hold.tokens - used))
        if self._waiters or self._batch_waiters:
            self._pump()

    def drain(self) -> None:
        """Stop admitting: every waiter (batch lines too) gets 503 now, every later request too."""
        self.draining = True
        for queue in (self._waiters, self._batch_waiters):
            while queue:
                waiter = queue.popleft()
                if not waiter.future.done():
                    waiter.future.set_exception(Unavailable("The server is shutting down and takes no new requests."))
