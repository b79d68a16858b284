"""What runs in the next engine step.

Each step the scheduler hands the engine a `Plan`: either one batch of prompt-only groups (scoring,
echo with max_tokens 0: they share one padded forward pass), or a decode step for every running group
(one batched pass over all their rows) plus, next to it, one chunk of the group being prefilled. A new
request therefore joins the running batch within a step or two, finished ones leave at once, and a long
prompt is prefilled a chunk per step without holding back the others' decoding.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .request import SequenceGroup


@dataclass
class Plan:
    score: list[SequenceGroup] = field(default_factory=list)
    prefill: list[SequenceGroup] = field(default_factory=list)
    decode: list[SequenceGroup] = field(default_factory=list)

    @property
    def groups(self) -> list[SequenceGroup]:
        return self.score + self.prefill + self.decode


class Scheduler:
    def __init__(self, max_running: int = 64, score_batch_tokens: int = 4096, max_score_batch: int = 64,
                 score_batch_tokens_decoding: int = 512,
                 prefill_tokens: int = 2048, max_prefilling: int = 32, remaining=None):
        self.max_running = max_running  # groups decoding (or prefilling) at once
        self.score_batch_tokens = score_batch_tokens  # padded tokens in one batched prompt-only pass
        self.score_batch_tokens_decoding = score_batch_tokens_decoding  # the same, while others decode
        self.max_score_batch = max_score_batch
        self.prefill_tokens = prefill_tokens  # prompt tokens still to prefill, over the groups admitted to it
        self.max_prefilling = max_prefilling
        self.remaining = remaining or (lambda group: group.num_prompt_tokens)  # prompt tokens not yet prefilled
        self.waiting: deque[SequenceGroup] = deque()
        self.prefilling: list[SequenceGroup] = []
        self.running: list[SequenceGroup] = []
        self.dropped: list[SequenceGroup] = []  # aborted groups whose resources the engine must free

    def add(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    @property
    def num_in_flight(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.prefilling)

    def _drop_aborted(self) -> None:
        for queue in (self.waiting, self.running, self.prefilling):
            for group in [g for g in queue if g.is_aborted]:
                queue.remove(group)
                self.dropped.append(group)

    def schedule(self) -> Plan | None:
        """The next step's work, or None when idle: a batch of prompt-only groups (when one is first in
        line), the prompts being prefilled (new ones join while their tokens fit `prefill_tokens`), and
        one decode step of every running group. Aborted groups are dropped first, before they cost a
        forward pass."""
        self._drop_aborted()
        score = []
        if self.waiting and self.waiting[0].params.max_tokens == 0:
            score = self._take_prompt_only()
        pending = sum(self.remaining(g) for g in self.prefilling)
        while (self.waiting and self.waiting[0].params.max_tokens > 0 and len(self.prefilling) < self.max_prefilling
               and len(self.running) + len(self.prefilling) < self.max_running
               and (not self.prefilling or pending < self.prefill_tokens)):
            group = self.waiting.popleft()
            pending += self.remaining(group)
            self.prefilling.append(group)
        if not (score or self.prefilling or self.running):
            return None
        return Plan(score=score, prefill=list(self.prefilling), decode=list(self.running))

    def _take_prompt_only(self) -> list[SequenceGroup]:
        """Consecutive waiting groups that only read their prompt, as many as fit one padded batch (a
        smaller one while other groups decode, so that their step stays short)."""
        batch = [self.waiting.popleft()]
        longest = batch[0].num_prompt_tokens
        budget = self.score_batch_tokens_decoding if self.running else self.score_batch_tokens
        while self.waiting and self.waiting[0].params.max_tokens == 0 and len(batch) < self.max_score_batch:
            nxt = self.waiting[0]
            if max(longest, nxt.num_prompt_tokens) * (len(batch) + 1) > budget:
                break
            longest = max(longest, nxt.num_prompt_tokens)
            batch.append(self.waiting.popleft())
        return batch

    def prefilled(self, group: SequenceGroup) -> None:
        """The group's prompt is done; it decodes from the next step on (unless it already finished)."""
        if group in self.prefilling:
            self.prefilling.remove(group)
        if not group.is_finished:
            self.running.append(group)

    def finished(self, group: SequenceGroup) -> None:
        if group in self.running:
            self.running.remove(group)
        if group in self.prefilling:
            self.prefilling.remove(group)
