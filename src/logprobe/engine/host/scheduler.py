"""What runs in the next engine step: every scheduling decision, made on groups alone (no model).

Each step the scheduler hands the engine a `Plan`: a pass of prompt-only groups (scoring, echo with
max_tokens 0: they share one padded forward pass) when one is first in line, one decode step of every
running group (one batched pass over all their rows), and the next chunk of each prompt being prefilled.
A new request therefore joins the running batch within a step or two, finished ones leave at once, and
a long prompt is prefilled a chunk per step without holding back the others' decoding. Token trees
(engine/host/tree.py) skip the queue: each grows one level, one pass of its own, in every step until done.

Waiting groups are served in arrival order within two classes: interactive groups (HTTP requests)
before batch groups (lines of a /v1/batches job, `SequenceGroup.priority`), so an interactive request
never waits behind queued batch lines. While an interactive group waits, no batch group is admitted to
a prompt-only batch or to prefill, and a step that carries an interactive prompt gives no chunk to a
batch prompt being prefilled; running batch rows keep decoding (they share the batched pass, and need
no preemption). Interactive prompts are admitted to prefill against the interactive ones only (batch
prompts set aside do not fill `max_prefilling` or `prefill_tokens` for them). Batch groups take at most
`max_batch_running` of the `max_running` slots (an eighth is kept for interactive groups, so that one
arriving finds a slot at once); past that, the next free slot goes to the interactive group. When
nothing interactive waits, batch groups fill the machine up to their slots.
Batch work is also cut small: a step gives batch groups at most `batch_step_tokens` prompt tokens
of prefill chunks, so an interactive request arriving mid-step waits for that much work at most.

A prompt-only pass (`PromptPass`) is a plan item that may take several steps, where the runner can
pause it between its blocks (`interleaves`, the lean runner): each step advances it until the work
that waits is worth a step of its own (`should_pause`), and the next plan goes on with it beside that
work. No step runs inside another. A batch prompt-only pass (scoring lines) is therefore longer, up to
`batch_pass_tokens`: it pauses at the next block whenever an interactive group has work
(`_beside_batch_pass`), so it delays an interactive request by a block, not by the pass. Where the runner
cannot pause, a batch prompt-only pass holds `batch_step_tokens` at most, and a longer scoring line is
prefilled in chunks. (Interactive prompt-only requests as 512-token prefill chunks instead: the same bits
and throughput, an arriving stream's first token 22-33x its idle time instead of 1.2-1.4x;
docs/performance.md, "Prompt-only work as prefill chunks instead".)
An interactive prompt-only pass (a `/v1/score` request, up to `score_batch_tokens` padded tokens) pauses
too (`_beside_interactive_pass`): the prompts of interactive generations are admitted past the
prompt-only groups queued before them, so a stream's first token waits for a block of scoring, not for
every queued score pass, and the running rows decode a step once per `score_batch_tokens_decoding`
padded tokens of the pass, so that one long prompt does not stall them. While rows decode, such a pass
takes `score_batch_tokens_decoding` padded tokens (a longer prompt alone): a pass of eight 500-token
requests beside 16 decoding streams gained no measurable throughput and made its blocks, which an
arriving stream's first token waits for, eight times longer (docs/performance.md, Mixed load).

The scheduler keeps how many prompt tokens of each group have been computed
(`SequenceGroup.num_computed_tokens`): from the prefix cache's hit, which it finds in the engine's
prefix index (host/prefix_index.py) as it admits the group to prefill (the tokens held are not
computed, so no chunk and no budget charges for them; the runner takes the hit's keys and values:
`start_prompt`), then a chunk counted as done when it is planned: a step that fails fails its groups
(engine/core.py), so the count never runs ahead of a group that lives.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from ...config import SchedulerSettings
from .prefix_index import PrefixIndex, uses_prefix_cache
from .request import SequenceGroup
from .tree import TreeGroup

UNLIMITED = 1 << 30


class Chunk(NamedTuple):
    """The next `num_tokens` prompt tokens of `group` (a runner's `prefill_chunks` takes these)."""

    group: SequenceGroup
    num_tokens: int


@dataclass(eq=False)
class PromptPass:
    """Prompt-only groups (scoring, echo with max_tokens 0) in one padded pass, which may take several
    steps: the engine advances it in each step the scheduler plans it (`Plan.prompt_pass`), block by
    block, until it is done or the scheduler has other work waiting (`Scheduler.should_pause`); the
    next step goes on where it stopped. `steps` is the runner's pass in progress (its `prompt_pass`,
    made and advanced by the engine; opaque here), `tokens` the padded positions it has run since the
    running rows last decoded."""

    groups: list[SequenceGroup]
    steps: object = None
    tokens: float = 0.0

    @property
    def is_batch(self) -> bool:
        return self.groups[0].is_batch


@dataclass
class Plan:
    """One engine step's items, run in this order (engine/core.py `step`): the interventions of the
    prompts that start (`edits`), one decode step of every running group, the next chunk of each prompt
    being prefilled (with the decode rows in one pass where the runner can), a prompt-only pass advanced
    (started, or resumed where an earlier step paused it), a level of each token tree, and the captures
    of the groups that finished before."""

    prompt_pass: PromptPass | None = None  # advanced in this step: to its end, or until others' work waits
    prefill: list[Chunk] = field(default_factory=list)  # prompt chunks, in order, packed in one pass
    decode: list[SequenceGroup] = field(default_factory=list)  # one token for each active row
    trees: list[TreeGroup] = field(default_factory=list)  # token trees: a level (a pass) of each (engine/host/tree.py)
    # finished groups whose captures (activations, the lens, the unmodified log probabilities) are read in
    # this step: a pass over each choice's tokens (engine/host/captures.py), before their answer goes out
    captures: list[SequenceGroup] = field(default_factory=list)
    # groups of this plan's prompts whose interventions are made ready before their first pass (a patch's
    # vector read from a clean pass over its source prompt: engine/runners/interventions.py)
    edits: list[SequenceGroup] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        starting = self.score if self.prompt_pass is not None and self.prompt_pass.steps is None else []
        self.edits = [g for g in starting + [c.group for c in self.prefill]
                      if g.params.interventions and g.edits is None]

    @property
    def score(self) -> list[SequenceGroup]:
        """The groups of the prompt-only pass this step advances."""
        return [] if self.prompt_pass is None else self.prompt_pass.groups

    def drop_failed(self) -> None:
        """Leave out the prompts whose groups failed before the passes (their edits could not be made)."""
        self.prefill = [c for c in self.prefill if c.group.error is None]
        if self.prompt_pass is not None:
            self.prompt_pass.groups = [g for g in self.prompt_pass.groups if g.error is None]

    @property
    def groups(self) -> list[SequenceGroup]:
        return self.score + [c.group for c in self.prefill] + self.decode + self.trees + self.captures

    @property
    def num_rows(self) -> int:
        """What the step observer counts: a row per prompt, a row per decoding sequence."""
        return (len(self.score) + len(self.prefill) + sum(len(g.active_rows) for g in self.decode)
                + len(self.trees) + len(self.captures))


class Scheduler:
    def __init__(self, settings: SchedulerSettings = SchedulerSettings(), prefill_chunk_tokens: int | None = None,
                 interleaves: bool = False, start_prompt: Callable[..., None] | None = None,
                 prefix_index: PrefixIndex | None = None):
        """`settings`: the budgets (config.py); `prefill_chunk_tokens` and `interleaves`: what the runner
        does (below); `prefix_index`: the engine's prefix cache (None: nothing is kept), where a prompt
        admitted to prefill finds what is held of it; `start_prompt(group, hit, held)`: the runner's,
        called then with what was found (None: a scheduler without a runner)."""
        self.start_prompt = start_prompt or (lambda group, hit, held: None)
        self.prefix_index = prefix_index
        max_running, score_batch_tokens = settings.max_running, settings.score_batch_tokens
        max_score_batch, score_batch_tokens_decoding = settings.max_score_batch, settings.score_batch_tokens_decoding
        prefill_tokens, max_prefilling = settings.prefill_tokens, settings.max_prefilling
        packed_prefill_tokens, linger_s = settings.packed_prefill_tokens, settings.linger_s
        batch_step_tokens, batch_pass_tokens = settings.batch_step_tokens, settings.batch_pass_tokens
        self.max_running = max_running  # groups decoding (or prefilling) at once
        self.score_batch_tokens = score_batch_tokens  # padded tokens in one batched prompt-only pass
        # the same while others decode; where the runner stops between blocks, also the padded tokens of a
        # pass between two of their decode steps
        self.score_batch_tokens_decoding = score_batch_tokens_decoding
        self.max_score_batch = max_score_batch
        self.prefill_tokens = prefill_tokens  # prompt tokens still to prefill, over the groups admitted to it
        self.max_prefilling = max_prefilling
        # Prompt tokens prefilled per step next to decoding groups, so that a long prompt does not stall
        # them (None: the runner prefills a prompt whole, ModelRunner's way) ...
        self.prefill_chunk_tokens = prefill_chunk_tokens
        # ... and of several prompts packed in one pass when none decode (one prompt alone goes whole).
        self.packed_prefill_tokens = packed_prefill_tokens
        self.linger_s = linger_s  # the longest a prompt-only batch waits for its usual companions
        # Prompt tokens batch groups take in one step (a prompt-only pass, or prefill chunks where the
        # runner chunks): an interactive request that arrives mid-step waits for at most that much work.
        # A batch prompt-only group longer than this goes through chunked prefill instead.
        self.batch_step_tokens = batch_step_tokens
        # Padded tokens of a batch prompt-only pass where the runner stops between blocks for interactive
        # steps (`interleaves`): a longer pass costs an arriving request nothing more, and runs the
        # products at a better size (benchmarks/batch.py).
        self.interleaves = interleaves
        self.batch_pass_tokens = batch_pass_tokens
        self.waiting: deque[SequenceGroup] = deque()
        self.prefilling: list[SequenceGroup] = []
        self.running: list[SequenceGroup] = []
        self.dropped: list[SequenceGroup] = []  # aborted groups whose resources the engine must free
        self.trees: list[TreeGroup] = []  # token trees growing, a level per step each, beside the other work
        self.capturing: list[SequenceGroup] = []  # finished groups whose captures the next step reads
        # prompt-only passes begun and not done: at most a batch one, then an interactive one begun while
        # the batch one was paused (the last is the one the steps advance)
        self.passes: list[PromptPass] = []
        self.last_prompt_only = 0  # groups in the last interactive prompt-only batch that ran alone

    def add(self, group: SequenceGroup) -> None:
        """Queue a group: a batch group at the end, an interactive one behind the interactive groups
        already waiting and ahead of every batch group (`waiting` stays in that order). A token tree
        grows from the next step on."""
        if isinstance(group, TreeGroup):
            self.trees.append(group)
        elif group.is_batch:
            self.waiting.append(group)
        else:
            first_batch = next((i for i, g in enumerate(self.waiting) if g.is_batch), len(self.waiting))
            self.waiting.insert(first_batch, group)

    @property
    def max_batch_running(self) -> int:
        """The slots batch groups may hold: all but an eighth of `max_running` (at least one each way)."""
        return max(1, self.max_running - max(1, self.max_running // 8))

    @property
    def is_interactive_waiting(self) -> bool:
        return bool(self.waiting) and not self.waiting[0].is_batch

    @property
    def has_interactive_work(self) -> bool:
        """Whether an interactive group waits, is being prefilled or decodes (what an interactive step runs)."""
        return self.is_interactive_waiting or \
            any(not g.is_batch for g in [*self.prefilling, *self.running, *self.capturing])

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling or self.trees or self.capturing or self.passes)

    @property
    def num_in_flight(self) -> int:
        return (len(self.waiting) + len(self.running) + len(self.prefilling) + len(self.trees) + len(self.capturing)
                + sum(len(p.groups) for p in self.passes))

    def schedule(self) -> Plan | None:
        """The next step's work, or None when idle. Aborted groups are dropped first, before they cost a
        forward pass (`take_dropped` hands them over). With no prompt-only pass begun: a new one (when
        prompt-only groups are first in line), a chunk of each prompt being prefilled (new ones join
        while their tokens fit `prefill_tokens`), one decode step of every running group, a level of
        each tree and the captures of the groups that finished (read in the step, before their answers
        go out). While a pass is begun, the step goes on with it beside the work that paused it
        (`_beside_batch_pass`, `_beside_interactive_pass`)."""
        self._drop_aborted()
        if self.passes and not self.passes[-1].is_batch:
            return self._beside_interactive_pass(self.passes[-1])
        if self.passes:
            return self._beside_batch_pass(self.passes[-1])
        interactive_waited = self.is_interactive_waiting  # then no batch group takes new budget this step
        new_pass = self._begin_pass() if self._prompt_only_first() else None
        self._admit_to_prefill(interactive_waited)
        prefilling, running, captures, trees = self.prefilling, self.running, self.capturing, list(self.trees)
        if not (new_pass or prefilling or running or trees or captures):
            return None
        self.capturing = []
        # a step with an interactive prompt in it gives batch prompts no chunk: that step stays short
        interactive_prompt = any(not g.is_batch for g in [*(new_pass.groups if new_pass else []), *prefilling])
        prefilling = [g for g in prefilling if not (interactive_prompt and g.is_batch)]
        plan = Plan(prompt_pass=new_pass, prefill=self._chunks(prefilling, decoding=bool(running)),
                    decode=list(running), trees=trees, captures=captures)
        if new_pass and not (plan.prefill or plan.decode or new_pass.is_batch):
            self.last_prompt_only = len(new_pass.groups)
        return plan

    def _beside_batch_pass(self, batch_pass: PromptPass) -> Plan:
        """A step while a batch prompt-only pass is begun: the pass goes on, and beside it the interactive
        groups' work: their prompts (a new interactive prompt-only pass, which this step advances
        instead, or chunks of their prompts; no batch prompt), the captures of interactive groups that
        finished, a level of each tree, and a decode step of every running group (batch ones too: a decode
        pass takes every row of the KV cache). The pass pauses for the next such step while interactive
        work waits (`should_pause`), so an interactive request waits for a block of batch work, not for
        the pass, and while interactive groups decode, the pass advances a block per step of theirs."""
        new_pass = self._begin_pass() if self._prompt_only_first(interactive_only=True) else None
        self._admit_to_prefill(no_batch=True)
        prefilling = [g for g in self.prefilling if not g.is_batch]
        captures = [g for g in self.capturing if not g.is_batch]
        self.capturing = [g for g in self.capturing if g.is_batch]
        return Plan(prompt_pass=new_pass or batch_pass, prefill=self._chunks(prefilling, decoding=bool(self.running)),
                    decode=list(self.running), trees=list(self.trees), captures=captures)

    def _beside_interactive_pass(self, current: PromptPass) -> Plan:
        """A step while an interactive prompt-only pass is begun: the pass goes on, and beside it the
        interactive generations' prompts, admitted past the prompt-only groups queued ahead of them (each
        of which would otherwise hold them for a whole pass) and prefilled a chunk a step, the captures
        of interactive groups that finished, a level of each tree, and a decode step of every running group
        (batch ones too) once the pass has run `score_batch_tokens_decoding` padded tokens since they last
        decoded, so that a long prompt does not stall them. No new prompt-only pass, no batch prompt."""
        i = 0
        while i < len(self.waiting) and not self.waiting[i].is_batch:
            group = self.waiting[i]
            if group.params.max_tokens == 0:
                i += 1
                continue
            ahead = [g for g in self.prefilling if not g.is_batch]
            pending = sum(g.num_prompt_tokens - g.num_computed_tokens for g in ahead)
            if len(self.running) + len(self.prefilling) >= self.max_running or len(ahead) >= self.max_prefilling \
                    or (ahead and pending >= self.prefill_tokens):
                break
            del self.waiting[i]
            self._begin_prefill(group)
        decode = bool(self.running) and current.tokens >= self.score_batch_tokens_decoding
        if decode:
            current.tokens = 0
        prefilling = [g for g in self.prefilling if not g.is_batch]
        captures = [g for g in self.capturing if not g.is_batch]
        self.capturing = [g for g in self.capturing if g.is_batch]
        return Plan(prompt_pass=current, prefill=self._chunks(prefilling, decoding=True),
                    decode=list(self.running) if decode else [], trees=list(self.trees), captures=captures)

    def should_pause(self, prompt_pass: PromptPass) -> bool:
        """Whether the engine should end its step at the pass's next pause point (after a block, before a
        head run) for the work that waits: for a batch pass, any interactive work (or a tree); for an
        interactive one, an interactive generation's prompt to admit or prefill, an interactive group's
        captures, or running rows due a decode step."""
        if prompt_pass.is_batch:
            return self.has_interactive_work or bool(self.trees)
        return self.has_prompts_to_admit or self.has_interactive_captures or \
            (bool(self.running) and prompt_pass.tokens >= self.score_batch_tokens_decoding)

    def pass_done(self, prompt_pass: PromptPass) -> None:
        """The pass ended (its groups are answered) or failed."""
        if prompt_pass in self.passes:
            self.passes.remove(prompt_pass)

    def _begin_pass(self) -> PromptPass:
        new_pass = PromptPass(self._take_prompt_only())
        self.passes.append(new_pass)
        return new_pass

    @property
    def has_prompts_to_admit(self) -> bool:
        """Whether an interactive generation's prompt waits (behind prompt-only groups or not) or is
        being prefilled: what a step beside an interactive pass would run."""
        return any(not g.is_batch and g.params.max_tokens > 0 for g in self.waiting) or \
            any(not g.is_batch for g in self.prefilling)

    @property
    def has_interactive_captures(self) -> bool:
        """Whether an interactive group that finished waits for its captures."""
        return any(not g.is_batch for g in self.capturing)

    def _prompt_only_first(self, interactive_only: bool = False) -> bool:
        if not self.waiting or (interactive_only and self.waiting[0].is_batch):
            return False
        return self.waiting[0].params.max_tokens == 0 and not self._chunked_batch(self.waiting[0])

    def _chunked_batch(self, group: SequenceGroup) -> bool:
        """A batch group whose prompt is longer than one step's batch work is prefilled in chunks (when the
        runner chunks), a prompt-only one too unless the runner interleaves: in one padded pass it would
        hold the step that long."""
        if not group.is_batch or self.prefill_chunk_tokens is None:
            return False
        limit = self.batch_pass_tokens if self.interleaves and group.params.max_tokens == 0 else self.batch_step_tokens
        return group.num_prompt_tokens > limit

    def _admit_to_prefill(self, no_batch: bool) -> None:
        """Move waiting groups, in order, to prefilling while there is a slot (`max_running`, or
        `max_batch_running` for a batch group), `max_prefilling` allows and the prompt tokens still to
        prefill stay under `prefill_tokens`: counted over the interactive groups for an interactive one,
        over all for a batch one. No batch group with `no_batch` (a step that began with an interactive
        group waiting, or an interactive step)."""
        while self.waiting and not self._prompt_only_first():
            group = self.waiting[0]
            slots = self.max_batch_running if group.is_batch else self.max_running
            if len(self.running) + len(self.prefilling) >= slots or (group.is_batch and no_batch):
                return
            ahead = [g for g in self.prefilling if group.is_batch or not g.is_batch]
            pending = sum(g.num_prompt_tokens - g.num_computed_tokens for g in ahead)
            if len(ahead) >= self.max_prefilling or (ahead and pending >= self.prefill_tokens):
                return
            self._begin_prefill(self.waiting.popleft())

    def _begin_prefill(self, group: SequenceGroup) -> None:
        """Admitted: the tokens the prefix cache holds (its longest kept prefix of the prompt, found here)
        are computed, the rest are planned in chunks (at least the last: its hidden state gives the first
        token); the runner takes the hit's keys and values from here on (`start_prompt`)."""
        hit, held = None, 0
        if self.prefix_index is not None and self.prefix_index.enabled and uses_prefix_cache(group.params):
            hit, held = self.prefix_index.start(group.prompt_ids, hidden=group.params.needs_prompt_logits)
        self.start_prompt(group, hit, held)
        group.num_computed_tokens = min(held, group.num_prompt_tokens - 1)
        self.prefilling.append(group)

    def _take_prompt_only(self) -> list[SequenceGroup]:
        """Consecutive waiting groups of one priority that only read their prompt, as many as fit one
        padded batch (a smaller one while other groups decode, so that their step stays short, and where
        the runner interleaves the blocks an arriving stream waits for too). Batch groups never join an
        interactive group's pass: it would be longer."""
        batch = [self.waiting.popleft()]
        longest = batch[0].num_prompt_tokens
        budget = self.score_batch_tokens_decoding if self.running else self.score_batch_tokens
        if batch[0].is_batch:
            budget = min(budget, self.batch_pass_tokens if self.interleaves else self.batch_step_tokens)
        while self._prompt_only_first() and len(batch) < self.max_score_batch:
            nxt = self.waiting[0]
            if nxt.is_batch != batch[0].is_batch:
                break
            if max(longest, nxt.num_prompt_tokens) * (len(batch) + 1) > budget:
                break
            longest = max(longest, nxt.num_prompt_tokens)
            batch.append(self.waiting.popleft())
        return batch

    def _chunks(self, prefilling: list[SequenceGroup], decoding: bool) -> list[Chunk]:
        """The next chunk of each of these prompts, in order, within this step's token budget: a chunk
        next to decoding groups, several whole short prompts when nothing decodes, or one prompt whole
        when it is alone."""
        if decoding:
            budget = self.prefill_chunk_tokens or UNLIMITED
        else:
            budget = UNLIMITED if len(prefilling) == 1 else self.packed_prefill_tokens
        # batch prompts share `batch_step_tokens` a step, where the runner chunks
        batch_budget = self.batch_step_tokens if self.prefill_chunk_tokens is not None else UNLIMITED
        chunks = []
        for group in prefilling:
            if budget <= 0:
                break
            room = min(budget, batch_budget) if group.is_batch else budget
            if room <= 0:
                continue
            num_tokens = max(1, min(group.num_prompt_tokens - group.num_computed_tokens, room))
            chunks.append(Chunk(group, num_tokens))
            group.num_computed_tokens = min(group.num_prompt_tokens, group.num_computed_tokens + num_tokens)
            budget -= num_tokens
            if group.is_batch:
                batch_budget -= num_tokens
        return chunks

    def should_linger(self) -> bool:
        """Whether the engine should wait (up to `linger_s`) for more requests before the next step.
        Closed-loop clients (an evaluation harness with N workers) send their next prompt-only request
        right after their answer. Without waiting, one that arrives first runs alone while the others
        arrive during its pass, and the batches split for good (1, 3, 1, 3... with 4 clients: a pass per
        text or two instead of one per four). So while nothing but prompt-only groups wait, fewer than
        the last prompt-only batch held, more are worth waiting for. A lone client (a batch of one
        after a batch of one) never waits, nor does anyone while batch lines wait (there is work to do,
        and a batch's runner sends its lines together)."""
        return (self.linger_s > 0 and not (self.running or self.prefilling or self.trees) and bool(self.waiting)
                and len(self.waiting) < self.last_prompt_only
                and all(g.params.max_tokens == 0 and not g.is_batch for g in self.waiting))

    def _drop_aborted(self) -> None:
        for queue in (self.waiting, self.running, self.prefilling, self.trees, self.capturing):
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
        if group in self.trees:
            self.trees.remove(group)
        if group in self.running:
            self.running.remove(group)
        if group in self.prefilling:
            self.prefilling.remove(group)
        if group in self.capturing:
            self.capturing.remove(group)

    def capture(self, group: SequenceGroup) -> None:
        """The group finished and asked for captures: it leaves the step's queues and waits for the next
        plan, which reads them (Plan.captures)."""
        self.finished(group)
        self.capturing.append(group)
