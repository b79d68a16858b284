"""Which group runs next. Waiting groups are prefilled first; running groups then take decode steps
in turn, so a long generation does not hold back the others. The engine batches nothing across groups
yet; the scheduler is the one place where that decision will be made."""

from __future__ import annotations

from collections import deque

from .request import SequenceGroup


class Scheduler:
    def __init__(self, max_running: int = 64, score_batch_tokens: int = 4096, max_score_batch: int = 64):
        self.max_running = max_running
        self.score_batch_tokens = score_batch_tokens  # padded tokens in one batched prompt-only pass
        self.max_score_batch = max_score_batch
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

    def schedule(self) -> tuple[str, SequenceGroup | list[SequenceGroup]] | None:
        """The next unit of work: ("score", [groups]), ("prefill", group) or ("decode", group), or None
        when idle.
        Aborted groups are dropped here, before they cost a forward pass."""
        for queue in (self.waiting, self.running):
            for group in [g for g in queue if g.is_aborted]:
                queue.remove(group)
                group.cache = None
        if self.waiting and self.waiting[0].params.max_tokens == 0:
            return "score", self._take_prompt_only()
        if self.waiting and len(self.running) < self.max_running:
            return "prefill", self.waiting.popleft()
        if self.running:
            group = self.running.popleft()
            return "decode", group
        return None

    def _take_prompt_only(self) -> list[SequenceGroup]:
        """Consecutive waiting groups that only read their prompt (max_tokens 0: scoring, echo), as many
        as fit one padded batch of `score_batch_tokens`: they share one forward pass."""
        batch = [self.waiting.popleft()]
        longest = batch[0].num_prompt_tokens
        while self.waiting and self.waiting[0].params.max_tokens == 0 and len(batch) < self.max_score_batch:
            nxt = self.waiting[0]
            if max(longest, nxt.num_prompt_tokens) * (len(batch) + 1) > self.score_batch_tokens:
                break
            longest = max(longest, nxt.num_prompt_tokens)
            batch.append(self.waiting.popleft())
        return batch

    def requeue(self, group: SequenceGroup) -> None:
        """A group that still has tokens to generate goes to the back of the running queue."""
        self.running.append(group)
