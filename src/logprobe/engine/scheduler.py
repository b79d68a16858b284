"""Which group runs next. Waiting groups are prefilled first; running groups then take decode steps
in turn, so a long generation does not hold back the others. The engine batches nothing across groups
yet; the scheduler is the one place where that decision will be made."""

from __future__ import annotations

from collections import deque

from .request import SequenceGroup


class Scheduler:
    def __init__(self, max_running: int = 64):
        self.max_running = max_running
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()

    def add(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_in_flight(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> tuple[str, SequenceGroup] | None:
        """The next unit of work: ("prefill", group) or ("decode", group), or None when idle.
        Aborted groups are dropped here, before they cost a forward pass."""
        for queue in (self.waiting, self.running):
            for group in [g for g in queue if g.is_aborted]:
                queue.remove(group)
                group.cache = None
        if self.waiting and len(self.running) < self.max_running:
            return "prefill", self.waiting.popleft()
        if self.running:
            group = self.running.popleft()
            return "decode", group
        return None

    def requeue(self, group: SequenceGroup) -> None:
        """A group that still has tokens to generate goes to the back of the running queue."""
        self.running.append(group)
