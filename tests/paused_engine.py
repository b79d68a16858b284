"""Hold an engine's step loop still, so that a test of a time-out never depends on the machine's speed."""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager


@contextmanager
def paused_after(engine, steps: int):
    """Inside the block, the engine's thread stops after its next `steps` steps and waits until the block
    is left: a request sent inside is certain to have been scheduled, and to have generated what those
    steps gave it, when its time-out fires on a fast machine. On a slow one the time-out may fire first:
    `timer_after` starts it only once the engine has paused (the block yields that event). The engine's
    own step observer (the metrics') still sees every step."""
    release, paused = threading.Event(), threading.Event()
    observer = engine.step_observer
    done = [0]

    def observe(seconds, rows):
        if observer is not None:
            observer(seconds, rows)
        done[0] += 1
        if done[0] >= steps:
            paused.set()
            release.wait()

    engine.step_observer = observe
    try:
        yield paused
    finally:
        engine.step_observer = observer
        release.set()


class timer_after:
    """Stands in for the `asyncio` module of the code under test (monkeypatch it there): `wait(...,
    timeout=T)` starts its T seconds only once `event` is set, so a request time-out fires after the
    steps the test let the engine run, however long they took (a wait without a time-out is asyncio's)."""

    def __init__(self, event: threading.Event):
        self._event = event

    def __getattr__(self, name):
        return getattr(asyncio, name)

    async def wait(self, tasks, *args, **kwargs):
        while kwargs.get("timeout") is not None and not self._event.is_set():
            await asyncio.sleep(0.005)
        return await asyncio.wait(tasks, *args, **kwargs)
