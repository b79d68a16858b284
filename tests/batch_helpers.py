"""What the Batch API tests share: JSONL files of request lines, an openai client over a TestClient,
waiting for a batch to end, and a gate that holds the fake backend still (so that a batch is certain to
have work in hand when a test cancels it or moves its clock, however fast or slow the machine)."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import orjson

TERMINAL = ("completed", "failed", "expired", "cancelled")


def request_line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(lines: list[dict]) -> bytes:
    return b"\n".join(orjson.dumps(line) for line in lines) + b"\n"


def sdk(client, api_key: str = "unused"):
    """The openai SDK speaking to a TestClient (an httpx.Client), no retries, no default time-out."""
    from openai import OpenAI

    return OpenAI(base_url="http://testserver/v1", api_key=api_key, http_client=client, max_retries=0, timeout=600)


def wait_for(oai, batch_id: str, statuses=TERMINAL, limit_s: float = 600):
    """The batch once its status is one of `statuses` (polled; the limit only stops a hung test)."""
    deadline = time.monotonic() + limit_s
    while True:
        batch = oai.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"batch {batch_id} still {batch.status} after {limit_s} s")
        time.sleep(0.05)


def until(condition, what: str, limit_s: float = 600) -> None:
    """Poll `condition` until it holds (the limit only stops a hung test)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {limit_s} s for {what}")
        time.sleep(0.01)


class Gate:
    """A FakeBackend's `gate`: the first `passes` runs go through; every later one waits before its first
    step until `open()`. `num_held` counts the runs waiting now (a cancelled one stops waiting),
    `num_entered` every run that reached the gate. Safe to read from the test's thread."""

    def __init__(self, passes: int = 0):
        self._lock = threading.Lock()
        self._opened = threading.Event()
        self._passes = passes
        self.num_entered = self.num_held = 0

    async def __call__(self) -> None:
        with self._lock:
            self.num_entered += 1
            if self._passes > 0 or self._opened.is_set():
                self._passes -= 1
                return
            self.num_held += 1
        try:
            while not self._opened.is_set():  # the event loop's thread must stay free: poll, never block
                await asyncio.sleep(0.005)
        finally:
            with self._lock:
                self.num_held -= 1

    def open(self) -> None:
        self._opened.set()


def settle(client, runner) -> None:
    """Return once the batch runner (on the TestClient's event loop) runs no line, holds no uncommitted
    answer, and has done two whole rounds since: it has had every chance to claim and write."""
    until(lambda: not runner.tasks and not runner.results, "the batch runner to stop running lines")
    for _ in range(2):  # the first round to end may have begun before; the second began after it
        seen = runner.num_rounds
        client.portal.call(runner.wake)  # on the loop's thread: asyncio.Event is not thread-safe
        until(lambda: runner.num_rounds > seen, "a round of the batch runner")
    until(lambda: not runner.tasks and not runner.results, "the batch runner to stop running lines")


def lines_of(oai, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [orjson.loads(x) for x in oai.files.content(file_id).content.splitlines() if x.strip()]


def without_ids(body):
    """An answer without what differs between two sendings of one body: its ids and creation time."""
    if isinstance(body, dict):
        return {k: without_ids(x) for k, x in body.items() if k not in ("id", "created", "created_at", "request_id")}
    if isinstance(body, list):
        return [without_ids(x) for x in body]
    return body


def assert_same_answer(got, want, tol: float = 1e-5, where: str = "") -> None:
    """The same answer: every key, string, integer and token equal; floats within `tol`, or relative `tol`
    for large ones (perplexity). `tol=0`: every number the same bits, which the lean runner in float32
    gives a request whatever runs beside it (docs/api.md); a tolerance where that does not hold (torch
    older than 2.13, whose attention kernel gives a kept prefix's queries other bits)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (where, got, want)
        for key in want:
            assert_same_answer(got[key], want[key], tol, f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (where, got, want)
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same_answer(a, b, tol, f"{where}[{i}]")
    elif tol and "rank" in where.rsplit(".", 1)[-1] and isinstance(want, int) and not isinstance(want, bool):
        # A rank under float32 rounding (a tolerance given): a near-tie in the tail (two of ~49k log
        # probabilities within rounding) may swap places where the numbers move: one place either way.
        assert isinstance(got, int) and abs(got - want) <= 1, (where, got, want)
    elif where.endswith(".cached_tokens"):
        # How much of a prompt the prefix cache held depends on what ran before (a body sent again finds
        # the blocks its first run kept): a count on both sides, not part of the answer.
        assert type(got) is type(want) is int and got >= 0 and want >= 0, (where, got, want)
    elif isinstance(want, float) and not isinstance(got, bool):
        assert isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=tol, abs_tol=tol), (where, got, want)
    else:
        assert got == want, (where, got, want)
