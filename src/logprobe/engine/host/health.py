"""The engine's health: its failures so far, whether it is failing, and when it next checks itself.

The step loop (core.py) decides what a failure does to the requests and to the runner; this module
keeps the count. A step that fails (a bug in a shared pass or in shared state) makes the engine
"failing" until a step succeeds again, and while it is failing and idle, a self-check (a tiny request
through the same paths as any other) runs at most every `SELF_CHECK_RETRY_S`. A request that fails on
its own is counted but leaves the engine healthy. No torch here.
"""

from __future__ import annotations

import time

from ...backend import SamplingParams
from ...tokens import TokenTable
from .request import SequenceGroup


class EngineHealth:
    """What /health reports of an engine, and the schedule of its self-checks."""

    SELF_CHECK_RETRY_S = 10.0  # while failing and idle, a self-check at most this often

    def __init__(self, check_ids: list[int]):
        self.step_failures = 0
        self.request_failures = 0
        self.last_error: tuple[str, float] | None = None  # (exception class, time.time())
        self.failing = False
        self._check_due: float | None = None  # when the next self-check may run (while failing)
        self._check_ids = check_ids  # the self-check's prompt

    def step_failed(self, exc: BaseException) -> None:
        """A step failed: the engine is failing, and checks itself at its next idle moment (unless a
        check is already due)."""
        self.step_failures += 1
        self.failing = True
        self.last_error = (type(exc).__name__, time.time())
        if self._check_due is None:  # the first failure after a success: check at the next idle moment
            self._check_due = time.monotonic()

    def request_failed(self, exc: BaseException) -> None:
        """One request failed on its own (after a shared pass that succeeded)."""
        self.request_failures += 1
        self.last_error = (type(exc).__name__, time.time())

    def step_succeeded(self) -> None:
        self.failing, self._check_due = False, None

    @property
    def is_check_due(self) -> bool:
        """Whether a self-check should be queued now (the engine is idle when this is asked)."""
        return self._check_due is not None and time.monotonic() >= self._check_due

    def self_check(self, table: TokenTable) -> SequenceGroup:
        """A two-token greedy generation through the same paths as a request (prefill, a cache row,
        decode): its steps succeeding clear "failing"; failing again keeps it (retried later)."""
        self._check_due = time.monotonic() + self.SELF_CHECK_RETRY_S
        params = SamplingParams(max_tokens=2, temperature=0.0)
        return SequenceGroup("self-check", list(self._check_ids), params, table)

    def report(self) -> dict:
        """Failing or not, and the failures so far (`Backend.stats`'s health keys)."""
        out = {"failing": self.failing, "step_failures": self.step_failures,
               "request_failures": self.request_failures}
        if self.last_error is not None:
            out["last_error"] = {"type": self.last_error[0], "at": round(self.last_error[1], 3)}
        return out
