"""What runs in the next engine step: every scheduling decision, made on groups alone (no model).

Each step the scheduler hands the engine a `Plan`: a batch of prompt-only groups (scoring, echo with
max_tokens 0: they share one padded forward pass) when one is first in line, one decode step of every
running group (one batched pass over all their rows), and the next chunk of each prompt being prefilled.
A new request therefore joins the running batch within a step or two, finished ones leave at once, and
a long prompt is prefilled a chunk per step without holding back the others' decoding.

Waiting groups are served in arrival order. The scheduler keeps how many prompt tokens of each group
have been computed (`SequenceGroup.num_computed_tokens`), counting a chunk as done when it plans it: a
step that fails fails its groups (engine/core.py), so the count never runs ahead of a group that lives.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from .request import SequenceGroup

UNLIMITED = 1 << 30


class Chunk(NamedTuple):
    """The next `num_tokens` prompt tokens of `group` (a runner's `prefill_chunks` takes these)."""

    group: SequenceGroup
    num_tokens: int


@dataclass
class Plan:
    score: list[SequenceGroup] = field(default_factory=list)  # prompt-only groups, one padded pass
    prefill: list[Chunk] = field(default_factory=list)  # prompt chunks, in order, packed in one pass
    decode: list[SequenceGroup] = field(default_factory=list)  # one token for each active row

    @property
    def groups(self) -> list[SequenceGroup]:
        return self.score + [c.group for c in self.prefill] + self.decode

    @property
    def num_rows(self) -> int:
        """What the step observer counts: a row per prompt, a row per decoding sequence."""
        return len(self.score) + len(self.prefill) + sum(len(g.active_rows) for g in self.decode)


class Scheduler:
    def __init__(self, max_running: int = 64, score_batch_tokens: int = 4096, max_score_batch: int = 64,
                 score_batch_tokens_decoding: int = 512, prefill_tokens: int = 2048, max_prefilling: int = 32,
                 prefill_chunk_tokens: int | None = None, packed_prefill_tokens: int = 2048,
                 linger_s: float = 0.02):
        self.max_running = max_running  # groups decoding (or prefilling) at once
        self.score_batch_tokens = score_batch_tokens  # padded tokens in one batched prompt-only pass
        self.score_batch_tokens_decoding = score_batch_tokens_decoding  # the same, while others decode
        self.max_score_batch = max_score_batch
        self.prefill_tokens = prefill_tokens  # prompt tokens still to prefill, over the groups admitted to it
        self.max_prefilling = max_prefilling
        # Prompt tokens prefilled per step next to decoding groups, so that a long prompt does not stall
        # them (None: the runner prefills a prompt whole, ModelRunner's way) ...
        self.prefill_chunk_tokens = prefill_chunk_tokens
        # ... and of several prompts packed in one pass when none decode (one prompt alone goes whole).
        self.packed_prefill_tokens = packed_prefill_tokens
        self.linger_s = linger_s  # the longest a prompt-only batch waits for its usual companions
        self.waiting: deque[SequenceGroup] = deque()
        self.prefilling: list[SequenceGroup] = []
        self.running: list[SequenceGroup] = []
        self.dropped: list[SequenceGroup] = []  # aborted groups whose resources the engine must free
        self.last_prompt_only = 0  # groups in the last batch of prompt-only groups that ran alone

    def add(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    @property
    def num_in_flight(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.prefilling)

    def schedule(self) -> Plan | None:
        """The next step's work, or None when idle: a batch of prompt-only groups (when one is first in
        line), a chunk of each prompt being prefilled (new ones join while their tokens fit
        `prefill_tokens`), and one decode step of every running group. Aborted groups are dropped first,
        before they cost a forward pass (`take_dropped` hands them over)."""
        self._drop_aborted()
        score = self._take_prompt_only() if self._prompt_only_first() else []
        pending = sum(g.num_prompt_tokens - g.num_computed_tokens for g in self.prefilling)
        while (self.waiting and not self._prompt_only_first() and len(self.prefilling) < self.max_prefilling
               and len(self.running) + len(self.prefilling) < self.max_running
               and (not self.prefilling or pending < self.prefill_tokens)):
            group = self.waiting.popleft()
            pending += group.num_prompt_tokens - group.num_computed_tokens
            self.prefilling.append(group)
        if not (score or self.prefilling or self.running):
            return None
        plan = Plan(score=score, prefill=self._chunks(decoding=bool(self.running)), decode=list(self.running))
        if score and not (plan.prefill or plan.decode):
            self.last_prompt_only = len(score)
        return plan

    def _prompt_only_first(self) -> bool:
        return bool(self.waiting) and self.waiting[0].params.max_tokens == 0

    def _take_prompt_only(self) -> list[SequenceGroup]:
        """Consecutive waiting groups that only read their prompt, as many as fit one padded batch (a
        smaller one while other groups decode, so that their step stays short)."""
        batch = [self.waiting.popleft()]
        longest = batch[0].num_prompt_tokens
        budget = self.score_batch_tokens_decoding if self.running else self.score_batch_tokens
        while self._prompt_only_first() and len(batch) < self.max_score_batch:
            nxt = self.waiting[0]
            if max(longest, nxt.num_prompt_tokens) * (len(batch) + 1) > budget:
                break
            longest = max(longest, nxt.num_prompt_tokens)
            batch.append(self.waiting.popleft())
        return batch

    def _chunks(self, decoding: bool) -> list[Chunk]:
        """The next chunk of each prompt being prefilled, in order, within this step's token budget: a
        chunk next to decoding groups, several whole short prompts when nothing decodes, or one prompt
        whole when it is alone."""
        if decoding:
            budget = self.prefill_chunk_tokens or UNLIMITED
        else:
            budget = UNLIMITED if len(self.prefilling) == 1 else self.packed_prefill_tokens
        chunks = []
        for group in self.prefilling:
            if budget <= 0:
                break
            num_tokens = max(1, min(group.num_prompt_tokens - group.num_computed_tokens, budget))
            chunks.append(Chunk(group, num_tokens))
            group.num_computed_tokens = min(group.num_prompt_tokens, group.num_computed_tokens + num_tokens)
            budget -= num_tokens
        return chunks

    def should_linger(self) -> bool:
        """Whether the engine should wait (up to `linger_s`) for more requests before the next step.
        Closed-loop clients (an evaluation harness with N workers) send their next prompt-only request
        right after their answer. Without waiting, one that arrives first runs alone while the others
        arrive during its pass, and the batches split for good (1, 3, 1, 3... with 4 clients: a pass per
        text or two instead of one per four). So while nothing but prompt-only groups wait, fewer than
        the last prompt-only batch held, more are worth waiting for. A lone client (a batch of one
        after a batch of one) never waits."""
        return (self.linger_s > 0 and not (self.running or self.prefilling) and bool(self.waiting)
                and len(self.waiting) < self.last_prompt_only
                and all(g.params.max_tokens == 0 for g in self.waiting))

    def _drop_aborted(self) -> None:
        for queue in (self.waiting, self.running, self.prefilling):
            for group in [g for g in queue if g.is_aborted]:
                queue.remove(group)
                self.dropped.append(group)

    def take_dropped(self) -> list[SequenceGroup]:
        """The aborted groups dropped since the last call (the engine frees them and tells their caller)."""
        dropped, self.dropped = self.dropped, []
        return dropped

    def prefilled(self, group: SequenceGroup) -> None:
        """The group's prompt is done; it decodes from the next step on (unless it already finished)."""
        group.num_computed_tokens = group.num_prompt_tokens
        if group in self.prefilling:
            self.prefilling.remove(group)
        if not group.is_finished:
            self.running.append(group)

    def finished(self, group: SequenceGroup) -> None:
        if group in self.running:
            self.running.remove(group)
        if group in self.prefilling:
            self.prefilling.remove(group)
