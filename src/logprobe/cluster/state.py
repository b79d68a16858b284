"""What the replicas of one logprobe application share: a Ray actor that holds each API key's token
budget (one budget for the whole application, whatever replica or ingress a request meets) and the
replicas' latest reports (their stats and engine metrics, for /health and /metrics).

The actor runs the same token bucket as one process (api/serving/admission.py), in the same order: a key's
interactive requests take its budget ahead of its batch lines. `SharedAdmission` is the
ingress's side of it, with the interface of `Admission`, so the API code does not know the difference.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from dataclasses import dataclass

from ..api.serving.admission import BATCH_WAIT_S, Hold, TokenBucket, batch_never_fits_budget, budget_headers, budget_wait_too_long, never_fits_budget, over_capacity, waited_too_long
from ..api.errors import Unavailable
from ..backend import BATCH, INTERACTIVE

STALE_S = 5.0  # a replica that has not reported for this long is not counted as ready


@dataclass(eq=False)
class _Taker:
    tokens: int
    served: asyncio.Future  # done once its tokens are taken from the bucket


class _KeyLine:
    """One key's takers waiting for its budget: every interactive one ahead of every batch line (as in
    one process, a batch line never takes budget an interactive request of its key waits for), arrival
    order within each."""

    def __init__(self):
        self.interactive: collections.deque[_Taker] = collections.deque()
        self.batch: collections.deque[_Taker] = collections.deque()
        self.timer: asyncio.TimerHandle | None = None  # wakes the head at its refill time

    def head(self) -> _Taker | None:
        for queue in (self.interactive, self.batch):
            if queue:
                return queue[0]
        return None

    def remove(self, taker: _Taker) -> None:
        for queue in (self.interactive, self.batch):
            if taker in queue:
                queue.remove(taker)


class ClusterState:
    """The shared state (a Ray actor: `ray.remote(ClusterState)`; its methods run on one event loop, so
    no locks are needed: each key's line of takers is served by `_serve` on every event that can let its
    head through)."""

    def __init__(self, tokens_per_minute: int, clock=time.monotonic):
        self.tokens_per_minute = tokens_per_minute
        self.clock = clock
        self._buckets: dict[str, TokenBucket] = {}
        self._lines: dict[str, _KeyLine] = {}  # only keys with takers waiting
        self._reports: dict[str, tuple[float, dict, bytes]] = {}

    # ---- the token budget ---------------------------------------------------------------------
    def _bucket(self, key: str) -> TokenBucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(self.tokens_per_minute, self.clock())
        return bucket

    def _verdict(self, key: str, kind: str, **extra) -> dict:
        return {"kind": kind, "headers": budget_headers(self._bucket(key), self.tokens_per_minute, self.clock()),
                **extra}

    async def take(self, key: str, tokens: int, queue_timeout: float, priority: str = INTERACTIVE) -> dict:
        """Take `tokens` from the key's budget, waiting for the refill up to `queue_timeout` seconds.
        A key's interactive requests take in arrival order, ahead of its batch lines (`priority="batch"`,
        which take in arrival order after them); other keys never wait behind them. The verdict's kind:
        "ok", "never" (over the whole budget), "too_long" (the wait is known to pass queue_timeout:
        `wait`, `level`) or "timeout" (it did pass it)."""
        if tokens > self.tokens_per_minute:
            return self._verdict(key, "never")
        bucket = self._bucket(key)
        wait = bucket.wait_for(tokens, self.clock())
        if wait > queue_timeout:
            return self._verdict(key, "too_long", wait=wait, level=bucket.level)
        taker = _Taker(tokens, asyncio.get_running_loop().create_future())
        line = self._lines.setdefault(key, _KeyLine())
        (line.batch if priority == BATCH else line.interactive).append(taker)
        self._serve(key)
        try:
            if not taker.served.done():
                # asyncio.wait neither cancels `served` nor raises: its state alone says what happened
                await asyncio.wait((taker.served,), timeout=queue_timeout)
        except asyncio.CancelledError:  # the caller is gone (Ray cancels the actor's task)
            if taker.served.done():
                self.give_back(key, tokens)
            else:
                self._leave(key, taker)
            raise
        if not taker.served.done():
            self._leave(key, taker)
            return self._verdict(key, "timeout")
        return self._verdict(key, "ok")

    def _serve(self, key: str) -> None:
        """Let the key's line through while its head fits the bucket; else wake again at the head's
        refill time (a new head, a taker leaving or tokens given back call this sooner)."""
        line = self._lines.get(key)
        if line is None:
            return
        if line.timer is not None:
            line.timer.cancel()
            line.timer = None
        bucket = self._bucket(key)
        while (taker := line.head()) is not None:
            wait = bucket.wait_for(taker.tokens, self.clock())
            if wait > 0:
                line.timer = taker.served.get_loop().call_later(wait + 1e-3, self._serve, key)
                return
            bucket.level -= taker.tokens
            line.remove(taker)
            taker.served.set_result(None)
        del self._lines[key]

    def _leave(self, key: str, taker: _Taker) -> None:
        """A taker that timed out or was cancelled leaves its line; it may have held up those behind."""
        line = self._lines.get(key)
        if line is not None:
            line.remove(taker)
            self._serve(key)

    def give_back(self, key: str, tokens: int) -> None:
        """Tokens a request held but did not use (max_tokens it did not generate, or all of them when its
        replica died) go back to its key's budget."""
        if tokens <= 0:
            return
        bucket = self._bucket(key)
        bucket.refill(self.clock())
        bucket.level = min(bucket.size, bucket.level + tokens)
        self._serve(key)  # the key's waiting head may fit now

    # ---- replicas' reports ----------------------------------------------------------------------
    def report(self, replica: str, stats: dict, metrics_text: bytes) -> None:
        self._reports[replica] = (self.clock(), stats, metrics_text)

    def forget(self, replica: str) -> None:
        self._reports.pop(replica, None)

    def snapshot(self) -> dict:
        """{replica: {"age": seconds since its report, "stats": ..., "metrics": text}}; replicas silent for
        over a minute are dropped (a replaced replica has a new id)."""
        now = self.clock()
        for replica in [r for r, (at, _, _) in self._reports.items() if now - at > 60]:
            del self._reports[replica]
        return {r: {"age": now - at, "stats": stats, "metrics": text}
                for r, (at, stats, text) in self._reports.items()}


def cancel_call(call) -> None:
    """Cancel a call of an actor's method: a Ray ObjectRef with `ray.cancel` (an async actor's coroutine
    then sees CancelledError), an asyncio future (the actor's object called in process) itself."""
    if isinstance(call, asyncio.Future):
        call.cancel()
        return
    import ray

    ray.cancel(call)


@dataclass
class _Pending:
    count: int = 0


class SharedAdmission:
    """The hold at the ingress of an application of replicas.

    - The token budget (`tokens_per_minute`) is the ClusterState actor's: one for the application.
    - The capacity hold (`max_tokens_in_flight`) is each replica's own (it protects that replica's
      memory; ModelReplica holds it around the engine); here a request that can never fit one replica is
      refused before anything is queued, with the message one process gives.
    - `held`, `running` and `queue_depth` count this ingress's requests, for /health and /metrics.
    """

    def __init__(self, state, capacity: int, tokens_per_minute: int, queue_timeout: float):
        self.state = state  # a handle on the ClusterState actor
        self.capacity = capacity
        self.tokens_per_minute = tokens_per_minute
        self.queue_timeout = queue_timeout
        self.held = 0
        self.running = 0
        self.draining = False
        self._waiting = _Pending()
        self._withdrawals: set[asyncio.Future] = set()  # held until each ends (asyncio keeps weak references)
        self.on_queue_time = None

    @property
    def queue_depth(self) -> int:
        return self._waiting.count

    async def acquire(self, key: str, tokens: int, priority: str = "interactive") -> Hold:
        if self.draining:
            raise Unavailable("The server is shutting down and takes no new requests.")
        if tokens > self.capacity:
            raise over_capacity(tokens, self.capacity)
        hold = Hold(key, tokens, time.monotonic(), priority=priority)
        if self.tokens_per_minute:
            # a batch line waits for its key's budget however long it takes (never a 429)
            timeout = BATCH_WAIT_S if priority == "batch" else self.queue_timeout
            self._waiting.count += 1
            call = self.state.take.remote(key, tokens, timeout, priority)
            try:
                verdict = await call
            except asyncio.CancelledError:
                # The request is gone (its client left, its batch was cancelled). Being cancelled while
                # awaiting an actor's call leaves the call running, and at its turn it would take the
                # tokens for nobody: withdraw it, and end only once the actor has settled it, so that no
                # later call of this ingress (a release giving tokens back) reaches the actor first.
                withdrawal = asyncio.ensure_future(self._withdraw(call, key, tokens))
                self._withdrawals.add(withdrawal)
                withdrawal.add_done_callback(self._withdrawals.discard)
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(withdrawal)  # cancelled again, it still runs to its end
                raise
            finally:
                self._waiting.count -= 1
            headers = verdict["headers"]
            if verdict["kind"] == "never" and priority == "batch":
                raise batch_never_fits_budget(tokens, self.tokens_per_minute)
            if verdict["kind"] == "never":
                raise never_fits_budget(tokens, self.tokens_per_minute, headers)
            if verdict["kind"] == "too_long":
                raise budget_wait_too_long(tokens, verdict["level"], self.tokens_per_minute, verdict["wait"], headers)
            if verdict["kind"] == "timeout":
                raise waited_too_long(tokens, self.queue_timeout, headers)
            hold.headers = headers
        if self.draining:  # drained while it waited
            if self.tokens_per_minute:
                self.state.give_back.remote(key, tokens)
            raise Unavailable("The server is shutting down and takes no new requests.")
        hold.admitted_at = time.monotonic()
        self.held += tokens
        self.running += 1
        if self.on_queue_time is not None:
            self.on_queue_time(hold.queue_seconds)
        return hold

    async def _withdraw(self, call, key: str, tokens: int) -> None:
        """Cancel a call of `take` whose caller is gone and wait for its outcome: the actor's `take`
        leaves the line, or gives back what it took when cancelled; a call the actor had already
        answered "ok" before the cancellation reached it took the tokens, and they are given back here."""
        cancel_call(call)
        try:
            verdict = await call
        except (asyncio.CancelledError, Exception):  # cancelled (Ray: TaskCancelledError), or the actor is gone
            return
        if verdict["kind"] == "ok":
            self.state.give_back.remote(key, tokens)

    def release(self, hold: Hold, used: int) -> None:
        if hold.released:
            return
        hold.released = True
        self.held -= hold.tokens
        self.running -= 1
        if self.tokens_per_minute and hold.tokens > used:
            self.state.give_back.remote(hold.key, hold.tokens - used)

    def drain(self) -> None:
        self.draining = True
