"""The hold (admission.py) on its own: capacity, per-key budgets, the bounded queue, time-outs,
cancellation and draining, with a fake clock where time matters; batch lines (never rate limited,
behind interactive requests, within their share of the capacity)."""

from __future__ import annotations

import asyncio

import pytest

from logprobe.api.serving.admission import Admission, RateLimited, duration
from logprobe.api.errors import InvalidRequest, Unavailable


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def run(coro):
    return asyncio.run(coro)


def test_capacity_queue_and_release_order():
    async def main():
        adm = Admission(capacity=100)
        a = await adm.acquire("k", 60)
        assert (adm.held, adm.running) == (60, 1)
        waiting_b = asyncio.ensure_future(adm.acquire("k", 50))  # does not fit: waits
        waiting_c = asyncio.ensure_future(adm.acquire("k", 10))  # fits, but FIFO behind b (capacity-blocked)
        await asyncio.sleep(0.01)
        assert adm.queue_depth == 2 and not waiting_b.done() and not waiting_c.done()
        adm.release(a, used=60)
        b, c = await asyncio.gather(waiting_b, waiting_c)
        assert (adm.held, adm.running, adm.queue_depth) == (60, 2, 0)
        adm.release(b, used=0)
        adm.release(c, used=0)
        adm.release(c, used=0)  # idempotent
        assert (adm.held, adm.running) == (0, 0)

    run(main())


def test_request_larger_than_capacity_is_a_400():
    async def main():
        adm = Admission(capacity=100)
        with pytest.raises(InvalidRequest) as e:
            await adm.acquire("k", 101)
        assert "max_tokens_in_flight" in e.value.message and e.value.param == "max_tokens"
        assert adm.held == 0

    run(main())


def test_full_queue_gives_429_with_retry_after():
    async def main():
        adm = Admission(capacity=10, max_queue=2)
        first = await adm.acquire("k", 10)
        waiters = [asyncio.ensure_future(adm.acquire("k", 5)) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(RateLimited) as e:
            await adm.acquire("k", 5)
        assert e.value.status == 429 and e.value.code == "rate_limit_exceeded"
        assert int(e.value.headers["retry-after"]) >= 1 and "max_queue" in e.value.message
        adm.release(first, 10)
        for h in await asyncio.gather(*waiters):
            adm.release(h, 5)
        assert (adm.held, adm.running, adm.queue_depth) == (0, 0, 0)

    run(main())


def test_queue_timeout_gives_429_and_leaves_nothing_held():
    async def main():
        adm = Admission(capacity=10, queue_timeout=0.05)
        first = await adm.acquire("k", 10)
        with pytest.raises(RateLimited) as e:
            await adm.acquire("k", 1)
        assert "queue_timeout" in e.value.message
        assert adm.queue_depth == 0
        adm.release(first, 10)
        assert (adm.held, adm.running) == (0, 0)

    run(main())


def test_cancelled_waiter_leaves_the_queue_and_unblocks_those_behind():
    async def main():
        adm = Admission(capacity=10)
        first = await adm.acquire("k", 6)
        big = asyncio.ensure_future(adm.acquire("k", 10))  # blocks the queue
        small = asyncio.ensure_future(adm.acquire("k", 4))
        await asyncio.sleep(0.01)
        assert not small.done()
        big.cancel()  # its client went away
        hold = await asyncio.wait_for(small, 1)
        assert adm.held == 10 and adm.queue_depth == 0
        adm.release(first, 6)
        adm.release(hold, 4)
        assert (adm.held, adm.running) == (0, 0)

    run(main())


def test_key_budget_refills_and_refunds_unused_tokens():
    async def main():
        clock = Clock()
        adm = Admission(capacity=10_000, tokens_per_minute=600, queue_timeout=30, clock=clock)
        h = await adm.acquire("a", 500)
        assert h.headers["x-ratelimit-remaining-tokens"] == "100"
        assert h.headers["x-ratelimit-limit-tokens"] == "600"
        assert h.headers["x-ratelimit-reset-tokens"] == "50s"  # 500 tokens at 10 a second
        adm.release(h, used=200)  # 300 unused go back to the key
        h2 = await adm.acquire("a", 400)
        assert h2.headers["x-ratelimit-remaining-tokens"] == "0"
        # another key has its own budget
        other = await adm.acquire("b", 600)
        adm.release(other, 600)
        # 'a' needs 600 - 0 = 600 more: 60 s > queue_timeout -> 429 at once, with the wait as Retry-After
        with pytest.raises(RateLimited) as e:
            await adm.acquire("a", 600)
        assert e.value.headers["retry-after"] == "60"
        # more than the whole budget can never run
        with pytest.raises(RateLimited) as e:
            await adm.acquire("a", 601)
        assert "tokens_per_minute" in e.value.message
        clock.t += 10  # refills 100
        h3 = await adm.acquire("a", 100)
        adm.release(h2, 400)
        adm.release(h3, 100)
        assert (adm.held, adm.running) == (0, 0)

    run(main())


def test_budget_waiter_is_woken_by_the_refill_and_does_not_block_other_keys():
    async def main():
        adm = Admission(capacity=100_000, tokens_per_minute=60_000, queue_timeout=5)  # real clock: 1000 tok/s
        h = await adm.acquire("a", 60_000)
        waiting = asyncio.ensure_future(adm.acquire("a", 500))  # 0.5 s of refill from the first hold
        while adm.queue_depth != 1:  # 'a' waits in the queue
            await asyncio.sleep(0)
        other = await adm.acquire("b", 10)  # had it waited behind 'a', 'a' would be done first
        assert not waiting.done()  # 'b' was served while 'a' waited: not behind it
        got = await asyncio.wait_for(waiting, 60)
        assert got.queue_seconds > 0.3
        for x in (h, other, got):
            adm.release(x, x.tokens)
        assert (adm.held, adm.running) == (0, 0)

    run(main())


def test_drain_refuses_waiters_and_new_requests():
    async def main():
        adm = Admission(capacity=10)
        h = await adm.acquire("k", 10)
        waiting = asyncio.ensure_future(adm.acquire("k", 1))
        await asyncio.sleep(0)
        adm.drain()
        with pytest.raises(Unavailable):
            await waiting
        with pytest.raises(Unavailable):
            await adm.acquire("k", 1)
        adm.release(h, 10)
        assert (adm.held, adm.running, adm.queue_depth) == (0, 0, 0)

    run(main())


# ---- batch lines -----------------------------------------------------------------------------------


def test_batch_lines_are_never_refused_for_a_full_queue_or_a_long_wait():
    async def main():
        adm = Admission(capacity=10, max_queue=1, queue_timeout=0.02)
        first = await adm.acquire("k", 10)
        lines = [asyncio.ensure_future(adm.acquire("k", 3, priority="batch")) for _ in range(3)]
        interactive = asyncio.ensure_future(adm.acquire("k", 1))  # batch lines leave max_queue to it
        await asyncio.sleep(0)
        assert (adm.queue_depth, adm.batch_queue_depth) == (1, 3)
        with pytest.raises(RateLimited):  # a second interactive waiter is one too many
            await adm.acquire("k", 1)
        with pytest.raises(RateLimited) as e:
            await interactive  # waited past queue_timeout
        assert "queue_timeout" in e.value.message
        assert not any(line.done() for line in lines)  # the batch lines wait on
        adm.release(first, 10)
        # 3 + 3 of the 7 a batch may hold (batch_share 3/4 of 10); the third waits for one of them
        assert (adm.batch_held, adm.batch_queue_depth) == (6, 1)
        first_line = await asyncio.wait_for(lines[0], 5)
        assert not lines[2].done()
        adm.release(first_line, 3)
        for hold in await asyncio.wait_for(asyncio.gather(*lines[1:]), 5):
            adm.release(hold, 3)
        assert (adm.held, adm.batch_held, adm.running, adm.queue_depth, adm.batch_queue_depth) == (0, 0, 0, 0, 0)

    run(main())


def test_a_batch_line_waits_for_its_keys_budget_and_never_gets_a_429():
    async def main():
        adm = Admission(capacity=100_000, tokens_per_minute=60_000, queue_timeout=0.01)  # 1000 tokens/s
        spent = await adm.acquire("a", 60_000)
        with pytest.raises(RateLimited):  # a request would wait 100 ms for 100 tokens: past queue_timeout
            await adm.acquire("a", 100)
        line = await asyncio.wait_for(adm.acquire("a", 1000, priority="batch"), 60)  # a line waits: 1 s
        assert line.queue_seconds > 0.5 and line.priority == "batch"
        with pytest.raises(InvalidRequest) as e:  # more than a minute's budget: never, an error line
            await adm.acquire("a", 60_001, priority="batch")
        assert e.value.status == 400 and e.value.param == "max_tokens" and "tokens_per_minute" in e.value.message
        with pytest.raises(InvalidRequest):  # more than the server ever holds
            await adm.acquire("a", 100_001, priority="batch")
        for hold in (spent, line):
            adm.release(hold, hold.tokens)
        assert (adm.held, adm.batch_held, adm.running) == (0, 0, 0)

    run(main())


def test_interactive_waiters_are_admitted_before_batch_lines():
    async def main():
        adm = Admission(capacity=10)
        a, b = await adm.acquire("k", 5), await adm.acquire("k", 5)
        line = asyncio.ensure_future(adm.acquire("k", 5, priority="batch"))  # first in line ...
        interactive = asyncio.ensure_future(adm.acquire("k", 5))
        await asyncio.sleep(0)
        adm.release(a, 5)  # ... but the first 5 tokens freed go to the interactive request
        assert (adm.queue_depth, adm.batch_queue_depth) == (0, 1)
        await asyncio.wait_for(interactive, 5)
        assert not line.done()
        adm.release(b, 5)
        await asyncio.wait_for(line, 5)
        for hold in (interactive.result(), line.result()):
            adm.release(hold, 5)
        assert (adm.held, adm.running) == (0, 0)

    run(main())


def test_no_batch_line_is_admitted_while_an_interactive_request_waits_for_capacity():
    async def main():
        adm = Admission(capacity=10)
        first = await adm.acquire("k", 8)
        interactive = asyncio.ensure_future(adm.acquire("k", 5))
        line = asyncio.ensure_future(adm.acquire("other", 2, priority="batch"))  # would fit: 8 + 2
        await asyncio.sleep(0.01)
        assert not interactive.done() and not line.done()
        adm.release(first, 8)
        await asyncio.wait_for(asyncio.gather(interactive, line), 5)
        assert interactive.result().admitted_at <= line.result().admitted_at
        for hold in (interactive.result(), line.result()):
            adm.release(hold, 0)
        assert (adm.held, adm.batch_held, adm.running) == (0, 0, 0)

    run(main())


def test_batch_lines_hold_at_most_their_share_and_leave_room_for_requests():
    async def main():
        adm = Admission(capacity=100)
        lines = [asyncio.ensure_future(adm.acquire("k", 30, priority="batch")) for _ in range(3)]
        await asyncio.sleep(0)
        assert (adm.batch_held, adm.batch_queue_depth) == (60, 1)  # 90 > 75: the third waits
        interactive = await asyncio.wait_for(adm.acquire("k", 25), 0.5)  # a quarter is always free
        assert (adm.held, adm.batch_held) == (85, 60)
        for line in lines[:2]:
            adm.release(line.result(), 30)
        adm.release(await asyncio.wait_for(lines[2], 5), 30)
        adm.release(interactive, 25)
        big = await asyncio.wait_for(adm.acquire("k", 90, priority="batch"), 5)  # over the share, alone
        adm.release(big, 90)
        assert (adm.held, adm.batch_held, adm.running) == (0, 0, 0)

    run(main())


def test_a_key_waiting_for_its_budget_is_served_before_its_batch_lines():
    async def main():
        adm = Admission(capacity=100_000, tokens_per_minute=60_000, queue_timeout=5)  # 1000 tokens/s
        spent = await adm.acquire("a", 59_950)  # 50 left
        interactive = asyncio.ensure_future(adm.acquire("a", 100))  # waits about 50 ms for its budget
        await asyncio.sleep(0)
        own_line = asyncio.ensure_future(adm.acquire("a", 10, priority="batch"))  # 10 fit, but not before it
        other_line = await asyncio.wait_for(adm.acquire("b", 10, priority="batch"), 0.5)  # another key's
        await asyncio.wait_for(asyncio.gather(interactive, own_line), 5)
        assert interactive.result().admitted_at <= own_line.result().admitted_at
        for hold in (spent, interactive.result(), own_line.result(), other_line):
            adm.release(hold, hold.tokens)
        assert (adm.held, adm.running) == (0, 0)

    run(main())


def test_a_cancelled_batch_line_leaves_the_queue_and_drain_refuses_the_others():
    async def main():
        adm = Admission(capacity=10)
        first = await adm.acquire("k", 10)
        gone, waiting = (asyncio.ensure_future(adm.acquire("k", 1, priority="batch")) for _ in range(2))
        await asyncio.sleep(0)
        gone.cancel()  # the batch was cancelled
        await asyncio.gather(gone, return_exceptions=True)
        assert adm.batch_queue_depth == 1
        adm.drain()
        with pytest.raises(Unavailable):
            await waiting
        adm.release(first, 10)
        assert (adm.held, adm.running, adm.batch_queue_depth) == (0, 0, 0)

    run(main())


def test_duration_format():
    assert duration(0.25) == "250ms"
    assert duration(2.5) == "2.5s"
    assert duration(90) == "1m30s"
