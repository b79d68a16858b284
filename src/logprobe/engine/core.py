"""The engine's core: the step loop, on the engine thread only, and what one step does.

A step is schedule (host/scheduler.py: which groups, which prompt chunks), run (the runner's forward
passes, through the runner contract: contract.py), pick (the tokens, chosen on the device and brought to
the host in one array, host/picks.py) and record (host/output_processor.py, no torch: tokens, stops,
finish). The KV cache's rows are the engine's KV cache manager's (host/kv_manager.py, no torch): the
step asks it for room before a decode pass, counts the pass's positions after, and frees the rows of the
choices that end; the runner carries out what it decides on the memory it keeps. Per-request work after
a shared pass runs in `_per_request`, so a failure there fails that request only; a failure of the
shared pass fails the step's requests and resets the manager and the runner. The count of
failures and the self-check's schedule are the engine's health (host/health.py); constrained rows'
grammar masks are computed beside the decode pass (device/grammar_masks.py). Engine (engine.py) adds the
model, the thread and the async front.

The engine's folder shows its parts: host/ (torch-free: what a request is, scheduling, the caches'
decisions, what picks do on the host), runners/ (the model's passes and every tensor kept between them:
the KV and prefix caches' memory), device/ (picking and steering on the device after a pass), and here
the loop that joins them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import torch

from ..backend import ModelInfo, RequestAborted, RequestConflict
from ..config import SchedulerSettings
from ..tokens import TokenTable
from .host.captures import capture_finished, wants_captures
from .contract import Runner
from .device.grammar_masks import GrammarMasks
from .host.health import EngineHealth
from .host.kv_manager import KVManager
from .host.heap import trim_heap
from .device.instruments import pick_with_instruments
from .runners.interventions import Edits
from .host.output_processor import OutputProcessor
from .host.picks import Pick, pick_plain_groups, split_plain_picks
from .host.prefix_index import PrefixIndex, prompt_hits
from .host.request import SequenceGroup
from .host.scheduler import Chunk, Plan, PromptPass, Scheduler
from .device.tree_passes import grow_tree
from .device.steering import steering_of

log = logging.getLogger("logprobe.engine")


class EngineCore:
    IDLE_WAIT_S = 0.5  # an empty inbox for this long after work is "idle"

    def __init__(self, runner: Runner, info: ModelInfo, table: TokenTable, check_ids: list[int],
                 scheduling: SchedulerSettings = SchedulerSettings(), prefix_index: PrefixIndex | None = None,
                 kv: KVManager | None = None):
        """`prefix_index`: the engine's prefix cache, which the runner keeps its keys and values in; the
        scheduler finds a prompt's kept prefix there as it admits it (None: the runner keeps none).
        `kv`: the engine's KV cache manager (host/kv_manager.py), the one the runner's memory follows
        (None: a new one, for a runner that keeps a cache per request and carries out no operation)."""
        if not isinstance(runner, Runner):
            raise TypeError(f"{type(runner).__name__} does not implement the runner contract (engine/contract.py)")
        self.runner = runner
        # which rows of the KV cache each running group holds, and every decision that moves them: the
        # step calls it, the runner carries out what it decides
        self.kv = KVManager(info.context_length) if kv is None else kv
        self.info = info
        self.table = table
        # a runner that prefills in chunks says how many tokens it takes per step beside decoding rows; one
        # that can stop between its blocks lets interactive steps into a batch pass
        self.scheduler = Scheduler(scheduling, prefill_chunk_tokens=runner.prefill_chunk_tokens,
                                   interleaves=runner.interleaves, start_prompt=runner.start_prompt,
                                   prefix_index=prefix_index)
        self.outputs = OutputProcessor(info.context_length)
        self._inbox: queue.SimpleQueue[SequenceGroup | None] = queue.SimpleQueue()
        # held while one submit puts its groups: the loop takes them all into one schedule, never part
        self._submitting = threading.Lock()
        self._stopping = False
        self._alive = lambda: True
        self._looping = False
        self.num_steps = 0
        self.step_observer = None  # called on the engine thread with (seconds, rows) after each step
        self.failure_observer = None  # called on the engine thread with "step" or "request" after a failure
        # a step that fails fails the requests in it, resets the runner's shared state and queues a
        # self-check; the engine is "failing" from that failure until a step succeeds again
        self.health_state = EngineHealth(check_ids)
        self.grammar_masks = GrammarMasks()  # constrained rows' masks, computed beside the decode pass

    # ---- the loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        if self._looping:
            raise RuntimeError("the engine's step loop is already running")
        self._looping = True
        try:
            with torch.inference_mode():  # nothing on this thread needs autograd
                self._run_steps()
        finally:
            self._looping = False

    def _run_steps(self) -> None:
        trimmed_at = self.num_steps
        while not self._stopping and self._alive():
            idle = not self.scheduler.has_work
            self._drain_inbox(block=idle)
            if idle and not self.scheduler.has_work:
                if self.health_state.is_check_due:
                    self.scheduler.add(self.health_state.self_check(self.table))
                elif self.num_steps != trimmed_at:
                    # idle for IDLE_WAIT_S after work: shrink the KV cache and hand freed memory back to
                    # the OS (not between back-to-back requests: malloc_trim costs milliseconds)
                    self.on_idle()
                    trim_heap()
                    trimmed_at = self.num_steps
                continue
            self._linger()
            plan = self.scheduler.schedule()
            self._finish_dropped()
            if plan is not None:
                self._run_step(plan)

    def on_idle(self) -> None:
        """Nothing to do: the KV cache back to what its rows need (none: its first size), and the runner
        hands back what a busy spell took."""
        self.runner.move(self.kv.shrink())
        self.runner.on_idle()

    def _finish_dropped(self) -> None:
        for group in self.scheduler.take_dropped():  # aborted: whoever awaits them learns it
            self._release(group)
            if group.error is None:
                group.error = RequestAborted(group.request_id)
            self._finish(group)

    def _run_step(self, plan: Plan) -> None:
        num_rows, t0 = plan.num_rows, time.perf_counter()
        try:
            self.step(plan)
        except Exception as exc:  # a bug in a shared pass: fail its requests, reset, check
            log.exception("engine step failed for %s", ", ".join(g.request_id for g in plan.groups))
            self._step_failed(plan, exc)
            return
        if not self.kv.is_consistent(self.scheduler.running) or not self.runner.is_consistent(self.scheduler.running):
            # a request's failure after the shared pass left shared state out of step
            exc = RuntimeError("the KV cache is out of step with the running requests")
            log.error("%s after a step of %s", exc, ", ".join(g.request_id for g in plan.groups))
            self._step_failed(plan, exc)
            return
        self.health_state.step_succeeded()
        if self.step_observer is not None:
            self.step_observer(time.perf_counter() - t0, num_rows)

    def _linger(self) -> None:
        """Wait (up to the scheduler's `linger_s`) for the requests the scheduler expects
        (`Scheduler.should_linger`)."""
        if not self.scheduler.should_linger():
            return
        deadline = time.perf_counter() + self.scheduler.linger_s
        while self.scheduler.should_linger():
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            try:
                item = self._inbox.get(timeout=left)
            except queue.Empty:
                return
            if self._add_submitted(item):  # a stop request's wake-up was among them
                return

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self.IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        self._add_submitted(item)

    def _add_submitted(self, item: SequenceGroup | None) -> bool:
        """Hand the scheduler `item` and everything queued after it, waiting first for the rest of the
        submit it came with (the groups of one request reach the scheduler together, so its passes do
        not depend on how the threads ran). Whether a stop request's wake-up (None) was among them."""
        woken = False
        with self._submitting:
            while True:
                if item is None:
                    woken = True
                else:
                    self.scheduler.add(item)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    return woken

    # ---- one step: run, pick, record ------------------------------------------------------------
    def step(self, plan: Plan) -> None:
        """One engine step, the plan's items in order: the edits of the prompts that start (a clean pass
        per patch), one decode step for every running group, the next chunk of the prompts being
        prefilled (several short prompts share one forward pass), a prompt-only pass advanced (to its
        end, or until other work waits: `_advance`), a level of each token tree (its own pass), and the
        captures of the groups that finished before it (a pass over each choice's tokens), after which
        their answers go out. Every item's passes run here, one after another: none runs a step inside."""
        self.num_steps += 1
        for group in plan.edits:  # a request whose edits fail leaves the plan
            self._per_request(group, self._resolve)
        plan.drop_failed()
        if plan.prompt_pass is not None and not plan.prompt_pass.groups:  # every group of it failed its edits
            self.scheduler.pass_done(plan.prompt_pass)
            plan.prompt_pass = None
        # Decode first: the batch is then exactly the running groups' rows (a group whose prompt
        # finishes in this step joins the batch in the next one). Where the runner can, the decode rows
        # and the prompts' chunks share one pass (one read of the weights).
        if plan.decode:
            self._decode(plan.decode, plan.prefill)
        elif plan.prefill:
            self._prefill(plan.prefill)
        if plan.prompt_pass is not None:
            self._advance(plan.prompt_pass)
        for tree in plan.trees:  # each its own pass over its prompt or its newest level (engine/host/tree.py)
            self._per_request(tree, self._grow_tree)
        for group in plan.captures:
            self._per_request(group, self._captured)

    def _decode(self, groups: list[SequenceGroup], chunks: list[Chunk] = ()) -> None:
        """A decode step of `groups`, and the prompts' `chunks` (in the same pass where the runner can)."""
        k = max(g.params.logprobs or 0 for g in groups)
        prefilled = None
        self.runner.move(self.kv.make_room())  # a row whose size class is full moves into the next one
        with self.grammar_masks.beside(groups) as pending:  # on the grammar thread while the forward pass runs
            both = self.runner.decode_with_prefill(groups, chunks) if chunks else None
            if both is not None:
                (logprob_rows, prefilled), host = both, None
            elif any(g.picks_alone for g in groups):
                logprob_rows, host = self.runner.decode_groups(groups), None
            else:  # the runner may pick the tokens in its recorded pass
                logprob_rows, host = self.runner.decode_and_pick(groups, k)
        self.kv.advance()  # every row's next position is written
        for group, future in pending.items():
            self._per_request(group, self.grammar_masks.take, future)
        if host is None:
            picks = pick_plain_groups(groups, logprob_rows)
        else:
            picks = split_plain_picks(groups, [i for i, g in enumerate(groups) if g.active_rows], host, k)
        for group, rows, pick in zip(groups, logprob_rows, picks):
            if group.error is None:  # not one whose grammar failed above
                self._per_request(group, self._decoded, rows, pick)
        if chunks:
            self._prefill(chunks, prefilled)

    def new_grammar_state(self, constraint):
        """A new sequence's grammar state (engine/host/grammar.py), made when its group starts decoding or a
        tree is steered; looked up on the engine at each call, so a test may replace it."""
        from .host.grammar import new_state  # llguidance loads with the first constrained request

        return new_state(constraint, self)

    def _decoded(self, group: SequenceGroup, logprob_rows: torch.Tensor, pick: Pick | None) -> None:
        self._record(group, logprob_rows, pick)
        self._after_step(group)

    def _record(self, group: SequenceGroup, logprob_rows: torch.Tensor, pick: Pick | None,
                expanded: bool = True) -> None:
        """Hand the rows' pick to the output processor (picking them first for a request that asked for
        instruments or steers its draw); the runner drops the rows of the sequences that finished
        (`expanded`: the group holds rows already; its first pick comes before them)."""
        if pick is None:
            seeds = [group.sequences[i].next_seed() for i in group.active_rows]
            steering, masks, kept = steering_of(group, logprob_rows)
            pick = pick_with_instruments(logprob_rows, group.params, seeds, group.params.logprobs or 0,
                                         steering, masks, kept)
        num_rows = len(group.active_rows)
        keep = self.outputs.record(group, pick)
        if expanded and keep and len(keep) < num_rows:
            self.runner.select(group, keep, self.kv.select(group, keep))

    def _prefill(self, chunks: list[Chunk], done: list | None = None) -> None:
        """The prompts' chunks (`done`: their answers where a shared pass ran them already)."""
        for chunk, logprob_rows in zip(chunks, self.runner.prefill_chunks(chunks) if done is None else done):
            if logprob_rows is not None:  # the prompt is done: [1, V] for its first token
                self._per_request(chunk.group, self._prefilled, logprob_rows)

    def _prefilled(self, group: SequenceGroup, logprob_rows: torch.Tensor) -> None:
        group.prompt_columns = self.runner.prompt_columns(group)
        group.num_cached_tokens = self.runner.cached_tokens(group)
        if group.params.max_tokens == 0:
            self.outputs.finish_prompt_only(group)
        else:
            self.outputs.start_decoding(group)
            if group.params.constraint is not None:  # each choice's grammar, and its first mask
                self.grammar_masks.begin(group, self.new_grammar_state)
            rows = logprob_rows.expand(len(group.active_rows), -1)
            self._record(group, rows, pick_plain_groups([group], [rows])[0], expanded=False)
            if not group.is_finished:  # rows for the choices that go on (none for a one-token answer)
                self.runner.expand(group, *self.kv.expand(group, group.num_prompt_tokens))
        self.scheduler.prefilled(group)
        self._after_step(group)

    def _advance(self, prompt_pass: PromptPass) -> None:
        """Run the prompt-only pass (begun here at its first step: the runner's `prompt_pass`) to its end,
        or to the first of its pause points (after a block, before a head run) where the scheduler has
        other work waiting (`Scheduler.should_pause`, after taking new requests from the inbox): the
        step ends there and a later one goes on with the pass. An interactive request thus waits for a
        block of a long pass, not for the pass. When the pass ends, its groups' answers go out."""
        try:
            if prompt_pass.steps is None:  # begun, with its prompts' kept prefixes found now
                prompt_pass.steps = self.runner.prompt_pass(
                    prompt_pass.groups, prompt_hits(self.scheduler.prefix_index, prompt_pass.groups))
            for positions in prompt_pass.steps:  # per block: the positions it ran through; 0 before a head run
                if self._pause_point(prompt_pass, positions):
                    return  # paused: the scheduler keeps it for a later step
        except BaseException:
            self.scheduler.pass_done(prompt_pass)  # failed: its groups fail with the step (_step_failed)
            raise
        self.scheduler.pass_done(prompt_pass)
        for group in prompt_pass.groups:
            group.prompt_columns = self.runner.prompt_columns(group)
            group.num_cached_tokens = self.runner.cached_tokens(group)
            self.outputs.finish_prompt_only(group)
            self._per_request(group, self._after_step)

    def _pause_point(self, prompt_pass: PromptPass, positions: int) -> bool:
        """At a pause point of the pass (`positions`: what the block just done ran, 0 before a head run):
        take new requests from the inbox, and whether the step should end here (Scheduler.should_pause)."""
        prompt_pass.tokens += positions / self.info.num_layers  # in the pass's padded positions
        self._drain_inbox(block=False)
        return self.scheduler.should_pause(prompt_pass)

    def _grow_tree(self, tree) -> None:
        """A level of the tree; before its first pass (its prompt) the prompt's kept prefix is found in
        the engine's prefix index (a tree's pass is never modified: it always uses the cache)."""
        index = self.scheduler.prefix_index
        hit = index.find(tree.prompt_ids) if tree.level == 0 and index is not None else None
        grow_tree(self.runner, tree, self.new_grammar_state, hit)
        self._after_step(tree)

    def _resolve(self, group: SequenceGroup) -> None:
        """A request's interventions made ready for its passes (a patch's vector read from a clean pass
        over its source prompt), before its first pass."""
        group.edits = Edits.resolve(group.params.interventions, group.num_prompt_tokens, self.runner.device,
                                    lambda ids, layer: self.runner.residual_stream(ids, [layer])[layer])

    def _release(self, group) -> None:
        """The group is done: the manager frees its KV rows, the runner carries that out and drops its record."""
        self.runner.release(group, self.kv.release(group))

    def _after_step(self, group: SequenceGroup) -> None:
        if group.is_finished:
            self._release(group)
            if wants_captures(group):  # read in the next step (Plan.captures), which then reports it
                self.scheduler.capture(group)
                return
            self.scheduler.finished(group)
        self._report(group)

    def _captured(self, group: SequenceGroup) -> None:
        capture_finished(self.runner, group, self.info.num_layers)
        self.scheduler.finished(group)
        self._report(group)

    def _report(self, group: SequenceGroup) -> None:
        """Tell the group's caller what its step did (`on_step`), and that it finished (`on_finish`)."""
        if group.on_step is not None:
            try:
                group.on_step(group)
            except Exception:  # the front's callback failed (e.g. its event loop is gone): not our step's fault
                log.exception("on_step callback failed for %s", group.request_id)
                group.is_aborted = True
        if group.is_finished:
            self._finish(group)

    # ---- failures ----------------------------------------------------------------------------
    def _per_request(self, group: SequenceGroup, work, *args) -> None:
        """Per-request work after a shared pass (recording tokens, instruments, stops, callbacks): a
        failure fails this request only. A request whose own fields leave nothing to draw (RequestConflict)
        fails with that error, and is no failure of the engine's (not in /health)."""
        try:
            work(group, *args)
        except RequestConflict as exc:  # the request's own fields disagree: its error, not the engine's
            log.info("request %s refused: %s", group.request_id, exc.message)
            self._fail(group, exc)
        except Exception as exc:
            log.exception("request %s failed", group.request_id)
            self.health_state.request_failed(exc)
            if self.failure_observer is not None:
                self.failure_observer("request")
            self._fail(group, exc)

    def _fail(self, group: SequenceGroup, exc: BaseException) -> None:
        group.error = exc
        try:
            self._release(group)
        except Exception:
            log.exception("releasing %s failed", group.request_id)
        finally:
            self.scheduler.finished(group)
            self._finish(group)

    def _finish(self, group: SequenceGroup) -> None:
        if group.on_finish is not None:
            try:
                group.on_finish(group)
            except Exception:  # never let a request's callback stop the loop that serves the others
                log.exception("on_finish callback failed for %s", group.request_id)

    def _step_failed(self, plan: Plan, exc: Exception) -> None:
        """Fail the step's requests and every other one holding shared state, rebuild that state (the
        KV cache) from nothing, and queue a self-check: a failure never leaves the engine half-broken,
        and /health says "failing" until a step succeeds. A prompt-only pass the failure did not come
        from (one paused, or not begun when the step failed) holds no shared state: it goes on."""
        self.health_state.step_failed(exc)
        if self.failure_observer is not None:
            self.failure_observer("step")
        going_on = {id(g) for p in self.scheduler.passes for g in p.groups}
        groups = [g for g in plan.groups if id(g) not in going_on]
        holding = {id(g): g for g in [*groups, *self.scheduler.running, *self.scheduler.prefilling]}
        for group in holding.values():
            if not group.is_finished and group.error is None:
                self._fail(group, exc)
            else:
                self.scheduler.finished(group)
        self.kv.reset()
        try:
            self.runner.reset()
        except Exception:
            log.exception("resetting the runner failed")

    @property
    def health(self) -> dict:
        """What /health reports of the engine: failing or not, and its failures so far."""
        return self.health_state.report()

    # the health's numbers read on the engine itself (tests, and `Backend.stats`'s names)
    step_failures = property(lambda self: self.health_state.step_failures)
    request_failures = property(lambda self: self.health_state.request_failures)
    last_error = property(lambda self: self.health_state.last_error)
    failing = property(lambda self: self.health_state.failing)
