"""Progress of a scoring job: a tqdm bar on a terminal or in Jupyter, plain lines otherwise, or nothing.

Plain lines (to a log file or a pipe) come at most every `interval` seconds, plus one when the job
starts and one when it ends, so even a short job says what it did.
"""

from __future__ import annotations

import sys
import time


def make(mode: str, total: int, done: int = 0, stream=None, interval: float = 10.0):
    """`mode`: "auto" (a bar when `stream` is a terminal, else plain lines), "bar", "notebook"
    (tqdm.auto: a widget in Jupyter), "plain" or "none"."""
    stream = stream or sys.stderr
    if mode == "auto":
        mode = "bar" if getattr(stream, "isatty", lambda: False)() else "plain"
    if mode in ("bar", "notebook"):
        return BarProgress(total, done, stream, notebook=mode == "notebook")
    if mode == "plain":
        return PlainProgress(total, done, stream, interval)
    return NoProgress()


class NoProgress:
    def update(self, rows: int, tokens: int) -> None:
        return None

    def close(self) -> None:
        return None


class BarProgress:
    """tqdm: rows/s and the ETA from the bar, tokens/s in its postfix."""

    def __init__(self, total: int, done: int, stream, notebook: bool = False):
        if notebook:
            from tqdm.auto import tqdm
        else:
            from tqdm import tqdm
        self.bar = tqdm(total=total, initial=done, unit="row", file=stream, desc="scoring", dynamic_ncols=True)
        self.started = time.monotonic()
        self.tokens = 0

    def update(self, rows: int, tokens: int) -> None:
        self.tokens += tokens
        elapsed = max(time.monotonic() - self.started, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tokens/s", refresh=False)
        self.bar.update(rows)

    def close(self) -> None:
        self.bar.close()


class PlainProgress:
    """A line now and then: rows done of the total, rows/s, tokens/s, the ETA."""

    def __init__(self, total: int, done: int, stream, interval: float):
        self.total, self.done, self.stream, self.interval = total, done, stream, interval
        self.started = self.last = time.monotonic()
        self.rows = self.tokens = 0
        already = f" ({done} done before)" if done else ""
        self._print(f"scoring {total - done} rows{already}")

    def update(self, rows: int, tokens: int) -> None:
        self.rows += rows
        self.tokens += tokens
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            self._print(self._line(now))

    def close(self) -> None:
        self._print(self._line(time.monotonic()) + " - finished" if self.done + self.rows >= self.total
                    else self._line(time.monotonic()))

    def _line(self, now: float) -> str:
        elapsed = max(now - self.started, 1e-9)
        rows_per_s = self.rows / elapsed
        done = self.done + self.rows
        left = (self.total - done) / rows_per_s if rows_per_s > 0 else float("inf")
        eta = f"{left:,.0f} s" if left != float("inf") else "?"
        percent = 100.0 * done / self.total if self.total else 100.0
        return (f"{done}/{self.total} rows ({percent:.0f}%), {rows_per_s:,.1f} rows/s, "
                f"{self.tokens / elapsed:,.0f} tokens/s, {elapsed:,.0f} s elapsed, ETA {eta}")

    def _print(self, line: str) -> None:
        print(f"logprobe score: {line}", file=self.stream, flush=True)
