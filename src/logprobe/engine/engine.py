"""The engine: the one owner of the model, and the in-process `Backend` (backend.py).

A single thread runs the step loop (schedule, run, postprocess), so no two requests ever run the model
at once. The asyncio side (`run`, `stream`) turns `GenerationRequest`s into `SequenceGroup`s, submits
them and awaits their completion; it never touches the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

import numpy as np
import torch

from ..backend import (Delta, FinishReason, GenerationOutput, GenerationRequest, ModelInfo, RequestAborted,
                       SamplingParams, StreamEnd, finished_without_forward)
from .interventions import Edits
from .request import Sequence, SequenceGroup
from .streaming import attach_releasers
from . import fast_runner
from .runner import ModelRunner
from .sampler import BatchSettings, pick as pick_rows
from .scheduler import Scheduler
from ..tokens import TokenTable

log = logging.getLogger("logprobe.engine")


def describe_model(model, tokenizer, name: str, aliases: list[str]) -> ModelInfo:
    cfg = model.config
    eos_ids = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            eos_ids.add(source)
        elif isinstance(source, (list, tuple)):
            eos_ids.update(int(i) for i in source)
    probe = tokenizer("a", add_special_tokens=True).input_ids
    adds_bos = tokenizer.bos_token_id is not None and bool(probe) and probe[0] == tokenizer.bos_token_id
    return ModelInfo(
        name=name,
        aliases=list(aliases),
        num_layers=int(cfg.num_hidden_layers),
        d_model=int(cfg.hidden_size),
        vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        context_length=int(getattr(cfg, "max_position_embeddings", None) or tokenizer.model_max_length),
        dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        adds_bos=adds_bos,
        has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
        stop_token_ids=frozenset(eos_ids),
    )


class Engine:
    def __init__(self, model, tokenizer, name: str, aliases: list[str] = (), fast: bool | None = None,
                 max_model_len: int | None = None, kv_cache_positions: int = 256, prefix_cache_mb: int = 256):
        """`fast`: run the model on logprobe's own batched decode path, the lean path (default: wherever a
        family in engine/families/ runs it; why not is logged); False keeps transformers' forward with a
        cache per request.
        `max_model_len`: serve a shorter context than the model's (prompt + generated tokens), as vLLM's
        option of that name. `kv_cache_positions`: positions per slot the batched KV cache starts with
        (it doubles as sequences grow, up to the context, and returns to this size when idle).
        `prefix_cache_mb`: memory for prompt prefixes' keys and values kept across batches of prompt-only
        requests (engine/prefix_cache.py; 0 turns it off; the lean path only)."""
        self.model = model
        self.tokenizer = tokenizer
        self.info = describe_model(model, tokenizer, name, list(aliases))
        if max_model_len is not None:
            if not 1 <= max_model_len <= self.info.context_length:
                raise ValueError(f"max_model_len {max_model_len} is outside 1..{self.info.context_length} "
                                 "(the model's context length)")
            self.info.context_length = max_model_len
        if kv_cache_positions < 1:
            raise ValueError("kv_cache_positions must be at least 1")
        if prefix_cache_mb < 0:
            raise ValueError("prefix_cache_mb must be at least 0")
        self.table = TokenTable.build(tokenizer, self.info.vocab_size)
        use_fast = fast_runner.supports(model) if fast is None else fast
        grids = getattr(model, "logprobe_int4", None)
        if grids is not None and not use_fast:
            raise ValueError("4-bit decode weights need the fast path")
        self.runner = (fast_runner.FastRunner(model, grids, max_len=self.info.context_length,
                                              kv_positions=kv_cache_positions,
                                              prefix_cache_bytes=prefix_cache_mb * 2**20)
                       if use_fast else ModelRunner(model))
        self.info.quantization = "int4" if grids is not None else None
        self.info.runner = "lean" if use_fast else "transformers"
        _trim_heap()  # hand back what loading and packing freed (the weights' released copies)
        self.scheduler = Scheduler(remaining=lambda g: g.num_prompt_tokens - self.runner.prefill_progress(g))
        self._inbox: queue.SimpleQueue[SequenceGroup | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._alive = lambda: True
        self._looping = False
        self.num_steps = 0
        self._last_prompt_only = 0  # groups in the last batch of prompt-only groups run alone
        self.step_observer = None  # called on the engine thread with (seconds, rows) after each step
        self.failure_observer = None  # called on the engine thread with "step" or "request" after a failure
        self._running_by_id: dict[str, list[SequenceGroup]] = {}
        # Health: a step that fails (a bug in a shared pass or in shared state) fails the requests in it,
        # resets the runner's shared state and queues a self-check; the engine is "failing" from that
        # failure until a step succeeds again.
        self.step_failures = 0
        self.request_failures = 0
        self.last_error: tuple[str, float] | None = None  # (exception class, time.time())
        self.failing = False
        self._check_due: float | None = None  # when the next self-check may run (while failing)
        self._check_ids = (tokenizer("The", add_special_tokens=True).input_ids or [0])[:4]

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="logprobe-engine", daemon=True)
            self._thread.start()

    def run_forever(self, alive=lambda: True) -> None:
        """Run the step loop in the calling thread until `stop()` or until `alive()` is false. The
        server runs it in the main thread: torch's CPU kernels run ~25-30% slower from a secondary
        thread on these machines (measured: one-token request 78 -> 51 ms, one stream 12.5 -> 18 tok/s)."""
        self._alive = alive
        self._loop()

    def request_stop(self) -> None:
        """Ask the loop to end (safe from a signal handler)."""
        self._stopping = True
        self._inbox.put(None)

    def stop(self) -> None:
        self._stopping = True
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    @property
    def num_in_flight(self) -> int:
        return self.scheduler.num_in_flight + self._inbox.qsize()

    # ---- the async front -------------------------------------------------------------------
    def submit(self, groups: list[SequenceGroup]) -> list[asyncio.Future]:
        """Queue groups; each future resolves (on the running loop) when its group has finished.
        A group's `on_step`, if set, is called on the engine thread after each of its steps."""
        loop = asyncio.get_running_loop()
        futures = []
        for group in groups:
            fut = loop.create_future()
            group.on_finish = _resolver(loop, fut)
            futures.append(fut)
            self._inbox.put(group)
        return futures

    async def run_groups(self, groups: list[SequenceGroup]) -> list[SequenceGroup]:
        """Run groups to completion. Cancelling the awaiting task aborts them."""
        futures = self.submit(groups)
        try:
            await asyncio.gather(*futures)
        except BaseException:
            for group in groups:
                group.is_aborted = True
            raise
        return groups

    # ---- the Backend protocol (backend.py) -------------------------------------------------
    async def run(self, requests: list[GenerationRequest]) -> list[GenerationOutput]:
        """Run requests to the end; one that needs no forward pass is answered without queueing.
        Cancelling the awaiting task aborts them."""
        groups = {i: SequenceGroup.from_request(r, self.table) for i, r in enumerate(requests)
                  if r.params.needs_forward}
        with self._tracked(groups.values()):
            await self.run_groups(list(groups.values()))
        return [groups[i].output() if i in groups else finished_without_forward(r) for i, r in enumerate(requests)]

    async def stream(self, requests: list[GenerationRequest], k: int) -> AsyncIterator[list[Delta] | StreamEnd]:
        """Lists of Delta as steps release tokens, then a StreamEnd. Closing the iterator early (the
        client went away, a time-out) aborts the requests: the engine drops them before their next step."""
        loop = asyncio.get_running_loop()
        groups = [SequenceGroup.from_request(r, self.table) for r in requests]
        queue: asyncio.Queue = asyncio.Queue()
        attach_releasers(groups, k, loop, queue)
        with self._tracked(groups):
            done = asyncio.gather(*self.submit(groups))
            getter = None
            try:
                while True:
                    getter = asyncio.ensure_future(queue.get())
                    await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
                    if getter.done():
                        yield getter.result()
                        continue
                    getter.cancel()
                    while not queue.empty():  # deltas posted before the last future resolved
                        yield queue.get_nowait()
                    if done.exception() is not None:
                        raise done.exception()
                    break
                yield StreamEnd([g.num_prompt_tokens for g in groups],
                                [sum(len(s.token_ids) for s in g.sequences) for g in groups])
            finally:
                if getter is not None and not getter.done():
                    getter.cancel()
                for group in groups:
                    if not group.is_finished:
                        group.is_aborted = True
                if not done.done():
                    done.cancel()
                    done.add_done_callback(_consume)

    def abort(self, request_id: str) -> None:
        for group in self._running_by_id.get(request_id, ()):
            group.is_aborted = True

    def generated(self, request_id: str) -> int:
        """Tokens generated so far by the running requests with this id (what an abandoned request is
        charged for beside its prompt; at most the step in progress behind)."""
        return sum(len(seq.token_ids) for group in list(self._running_by_id.get(request_id, ()))
                   for seq in group.sequences)

    def stats(self) -> dict:
        return {"in_flight": self.num_in_flight, "steps": self.num_steps,
                "kv_cache_bytes": self.runner.kv_cache_bytes, "prefix_cache_bytes": self.runner.prefix_cache_bytes,
                **self.health}

    @contextlib.contextmanager
    def _tracked(self, groups):
        """Groups findable by request id (for `abort`) while they run."""
        groups = list(groups)
        for g in groups:
            self._running_by_id.setdefault(g.request_id, []).append(g)
        try:
            yield
        finally:
            for g in groups:
                held = self._running_by_id.get(g.request_id, [])
                if g in held:
                    held.remove(g)
                if not held:
                    self._running_by_id.pop(g.request_id, None)

    # ---- the step loop (engine thread only) ------------------------------------------------
    def _loop(self) -> None:
        if self._looping:
            raise RuntimeError("the engine's step loop is already running")
        self._looping = True
        try:
            with torch.inference_mode():  # nothing on this thread needs autograd
                self._run_steps()
        finally:
            self._looping = False

    @property
    def health(self) -> dict:
        """What /health reports of the engine: failing or not, and its failures so far."""
        out = {"failing": self.failing, "step_failures": self.step_failures,
               "request_failures": self.request_failures}
        if self.last_error is not None:
            out["last_error"] = {"type": self.last_error[0], "at": round(self.last_error[1], 3)}
        return out

    def _run_steps(self) -> None:
        trimmed_at = self.num_steps
        while not self._stopping and self._alive():
            idle = not self.scheduler.has_work
            self._drain_inbox(block=idle)
            if idle and not self.scheduler.has_work:
                if self._check_due is not None and time.monotonic() >= self._check_due:
                    self._queue_self_check()
                    continue
                if self.num_steps != trimmed_at:
                    # idle for IDLE_WAIT_S after work: shrink the KV cache and hand freed memory back to
                    # the OS (not between back-to-back requests: malloc_trim costs milliseconds)
                    self.runner.on_idle()
                    _trim_heap()
                    trimmed_at = self.num_steps
                continue
            self._linger()
            plan = self.scheduler.schedule()
            for group in self.scheduler.dropped:  # aborted: whoever awaits them learns it
                self.runner.release(group)
                if group.error is None:
                    group.error = RequestAborted(group.request_id)
                self._finish(group)
            self.scheduler.dropped.clear()
            if plan is None:
                continue
            rows = len(plan.score) + len(plan.prefill) + sum(len(g.active_rows) for g in plan.decode)
            t0 = time.perf_counter()
            try:
                self.step(plan)
            except Exception as exc:  # a bug in a shared pass: fail its requests, reset, check
                log.exception("engine step failed for %s", ", ".join(g.request_id for g in plan.groups))
                self._step_failed(plan.groups, exc)
                continue
            if not self.runner.is_consistent(self.scheduler.running):
                # a request's failure after the shared pass left shared state out of step
                exc = RuntimeError("the KV cache is out of step with the running requests")
                log.error("%s after a step of %s", exc, ", ".join(g.request_id for g in plan.groups))
                self._step_failed(plan.groups, exc)
                continue
            self.failing, self._check_due = False, None
            if self.step_observer is not None:
                self.step_observer(time.perf_counter() - t0, rows)

    SELF_CHECK_RETRY_S = 10.0  # while failing and idle, a self-check at most this often

    def _step_failed(self, groups: list[SequenceGroup], exc: Exception) -> None:
        """Fail the step's requests and every other one holding shared state, rebuild that state (the
        KV cache) from nothing, and queue a self-check: a failure never leaves the engine half-broken,
        and /health says "failing" until a step succeeds."""
        self.step_failures += 1
        self.failing = True
        self.last_error = (type(exc).__name__, time.time())
        if self.failure_observer is not None:
            self.failure_observer("step")
        holding = {id(g): g for g in [*groups, *self.scheduler.running, *self.scheduler.prefilling]}
        for group in holding.values():
            if not group.is_finished and group.error is None:
                self._fail(group, exc)
            else:
                self.scheduler.finished(group)
        try:
            self.runner.reset()
        except Exception:
            log.exception("resetting the runner failed")
        if self._check_due is None:  # the first failure after a success: check at the next idle moment
            self._check_due = time.monotonic()

    def _queue_self_check(self) -> None:
        """A two-token greedy generation through the same paths as a request (prefill, a cache row,
        decode): its steps succeeding clear "failing"; failing again keeps it (retried later)."""
        self._check_due = time.monotonic() + self.SELF_CHECK_RETRY_S
        params = SamplingParams(max_tokens=2, temperature=0.0)
        self.scheduler.add(SequenceGroup("self-check", list(self._check_ids), params, self.table))

    def _fail(self, group: SequenceGroup, exc: Exception) -> None:
        group.error = exc
        try:
            self.runner.release(group)
        except Exception:
            log.exception("releasing %s failed", group.request_id)
        finally:
            self.scheduler.finished(group)
            self._finish(group)

    def _each(self, group: SequenceGroup, work, *args) -> None:
        """Per-request work after a shared pass (recording tokens, instruments, stops, callbacks): a
        failure fails this request only."""
        try:
            work(group, *args)
        except Exception as exc:
            log.exception("request %s failed", group.request_id)
            self.request_failures += 1
            self.last_error = (type(exc).__name__, time.time())
            if self.failure_observer is not None:
                self.failure_observer("request")
            self._fail(group, exc)

    IDLE_WAIT_S = 0.5  # an empty inbox for this long after work is "idle"
    LINGER_S = 0.02  # the longest a prompt-only batch waits for its usual companions

    def _linger(self) -> None:
        """Closed-loop clients (an evaluation harness with N workers) send their next prompt-only
        request right after their answer. Without waiting, one that arrives first runs alone while the
        others arrive during its pass, and the batches split for good (1, 3, 1, 3... with 4 clients: a
        pass per text or two instead of one per four). So when the engine has nothing but prompt-only
        groups waiting, fewer than the last prompt-only batch held, it waits up to LINGER_S for more.
        A lone client (a batch of one after a batch of one) never waits."""
        s = self.scheduler
        if s.running or s.prefilling or not s.waiting or self.LINGER_S <= 0:
            return
        deadline = time.perf_counter() + self.LINGER_S
        while len(s.waiting) < self._last_prompt_only and all(g.params.max_tokens == 0 for g in s.waiting):
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            try:
                item = self._inbox.get(timeout=left)
            except queue.Empty:
                return
            if item is None:  # a stop request's wake-up
                return
            s.add(item)

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self.IDLE_WAIT_S) if block else self._inbox.get_nowait()
            while True:
                if item is not None:
                    self.scheduler.add(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return

    PACKED_PREFILL_TOKENS = 2048  # prompt tokens of several prompts prefilled in one pass, when none decode

    def step(self, plan) -> None:
        """One engine step: one decode step for every running group, the next chunk of the prompts being
        prefilled (several short prompts share one forward pass), and a batch of prompt-only groups."""
        self.num_steps += 1
        for group in plan.prefill + plan.score:
            if group.params.interventions and group.edits is None:
                self._each(group, self._resolve_edits)
        if any(g.error is not None for g in plan.prefill + plan.score):
            plan.prefill = [g for g in plan.prefill if g.error is None]
            plan.score = [g for g in plan.score if g.error is None]
        # Decode first: the batch is then exactly the running groups' rows (a group whose prompt
        # finishes in this step joins the batch in the next one).
        if plan.decode:
            picked, k = None, max(g.params.logprobs or 0 for g in plan.decode)
            if all(g.instruments is None for g in plan.decode):  # the runner may pick in its recorded pass
                lsms, picked = self.runner.decode_and_pick(plan.decode, k)
            else:
                lsms = self.runner.decode_groups(plan.decode)
            if picked is None:
                picks = self._pick(plan.decode, lsms)
            else:
                picks = self._split(plan.decode, [i for i, g in enumerate(plan.decode) if g.active_rows], picked, k)
            for group, lsm, pick in zip(plan.decode, lsms, picks):
                self._each(group, self._decoded, lsm, pick)
        if plan.prefill:
            self._prefill(plan.prefill, decoding=bool(plan.decode))
        if plan.score:
            if not (plan.decode or plan.prefill):
                self._last_prompt_only = len(plan.score)
            self.runner.prefill_batch(plan.score)
            for group in plan.score:
                for seq in group.sequences:
                    seq.finish_reason = FinishReason.LENGTH
                self._each(group, self._after_step)

    def _resolve_edits(self, group: SequenceGroup) -> None:
        """A request's interventions made ready for its passes (a patch's vector read from a clean pass
        over its source prompt), before its first pass."""
        group.edits = Edits.resolve(group.params.interventions, group.num_prompt_tokens, self.runner.device,
                                    lambda ids, layer: self.runner.residual_stream(ids, [layer])[layer])

    @property
    def runner_chunk(self) -> int:
        return getattr(self.runner, "PREFILL_CHUNK", 1 << 30)

    def _prefill(self, groups: list[SequenceGroup], decoding: bool) -> None:
        """The next chunk of each prompt being prefilled, in order, within this step's token budget: a
        prefill chunk next to decoding groups (so a long prompt does not stall them), several whole
        short prompts when nothing decodes, or one prompt whole when it is alone."""
        budget = self.runner_chunk if decoding else (1 << 30 if len(groups) == 1 else self.PACKED_PREFILL_TOKENS)
        chunks = []
        for group in groups:
            if budget <= 0:
                break
            take = max(1, min(group.num_prompt_tokens - self.runner.prefill_progress(group), budget))
            chunks.append((group, take))
            budget -= take
        for (group, _), lsm in zip(chunks, self.runner.prefill_chunks(chunks)):
            if lsm is not None:
                self._each(group, self._prefilled, lsm)

    def _decoded(self, group: SequenceGroup, lsm: torch.Tensor, pick) -> None:
        self._postprocess(group, lsm, pick)
        self._after_step(group)

    def _prefilled(self, group: SequenceGroup, lsm: torch.Tensor) -> None:
        if group.params.max_tokens == 0:
            for seq in group.sequences:
                seq.finish_reason = FinishReason.LENGTH
        else:
            group.active_rows = [s.index for s in group.sequences]
            self.runner.expand(group, len(group.active_rows))
            rows = lsm.expand(len(group.active_rows), -1)
            self._postprocess(group, rows, self._pick([group], [rows])[0])
        self.scheduler.prefilled(group)
        self._after_step(group)

    def _after_step(self, group: SequenceGroup) -> None:
        if group.is_finished:
            self.runner.release(group)
            self.scheduler.finished(group)
            if group.params.residual_layers:
                self._capture_residual(group)
            if group.params.lens_layers:
                self._capture_lens(group)
            if group.params.return_unmodified:
                self._capture_unmodified(group)
        if group.on_step is not None:
            try:
                group.on_step(group)
            except Exception:  # the front's callback failed (e.g. its event loop is gone): not our step's fault
                log.exception("on_step callback failed for %s", group.request_id)
                group.is_aborted = True
        if group.is_finished:
            self._finish(group)

    def _capture_residual(self, group: SequenceGroup) -> None:
        """Activations of every kept token of each choice, prompt then generated, from one forward pass
        over the whole sequence: a generated token's vector is the one computed when it is the input
        (the same as during decoding, without keeping hooks on the decode loop)."""
        layers = list(group.params.residual_layers)
        by_tokens: dict[tuple[int, ...], dict] = {}
        for seq in group.sequences:
            ids = tuple(group.prompt_ids) + tuple(seq.token_ids[:seq.num_kept_tokens])
            if ids not in by_tokens:
                by_tokens[ids] = self.runner.residual_stream(list(ids), layers, group.edits)
            seq.residual = by_tokens[ids]

    def _capture_lens(self, group: SequenceGroup) -> None:
        """The logit lens of every kept token of each choice, prompt then generated: one pass over the
        whole sequence, as for activations."""
        params = group.params
        layers = sorted({layer % (self.info.num_layers + 1) for layer in params.lens_layers})
        by_tokens: dict[tuple[int, ...], dict] = {}
        for seq in group.sequences:
            ids = tuple(group.prompt_ids) + tuple(seq.token_ids[:seq.num_kept_tokens])
            if ids not in by_tokens:
                by_tokens[ids] = self.runner.logit_lens(list(ids), layers, params.lens_top_k, group.edits)
            seq.lens = by_tokens[ids]

    def _capture_unmodified(self, group: SequenceGroup) -> None:
        """`return_unmodified`: each choice's prompt and kept tokens through a pass without the request's
        interventions (the last layer's lens is the model's own distribution), as wide a top-k as the
        request's `logprobs` and `prompt_logprobs` ask."""
        params, last = group.params, self.info.num_layers
        k = max(params.logprobs or 0, params.num_prompt_top)
        by_tokens: dict[tuple[int, ...], object] = {}
        for seq in group.sequences:
            ids = tuple(group.prompt_ids) + tuple(seq.token_ids[:seq.num_kept_tokens])
            if ids not in by_tokens:
                by_tokens[ids] = self.runner.logit_lens(list(ids), [last], k)[last]
            seq.unmodified = by_tokens[ids]

    def _pick(self, groups: list[SequenceGroup], lsms: list[torch.Tensor]) -> list:
        """The tokens of every active row of the plain groups (those whose request asked for no
        instrument) with their log probabilities and top-k, computed for all of them at once on the
        device and brought to the host in one transfer: per group, None (an instrumented group, which
        `Instruments` samples) or (tokens [R], their log probabilities [R], top ids [R, k], top log
        probabilities [R, k]) as numpy, k being the group's `logprobs`."""
        plain = [i for i, g in enumerate(groups) if g.instruments is None and g.active_rows]
        picks = [None] * len(groups)
        if not plain:
            return picks
        lsm = lsms[plain[0]] if len(plain) == 1 else torch.cat([lsms[i] for i in plain])
        seqs = [groups[i].sequences[j] for i in plain for j in groups[i].active_rows]
        params = [groups[i].params for i in plain for _ in groups[i].active_rows]
        seeds = None if all(p.is_greedy for p in params) else [s.next_seed() for s in seqs]
        k = max(groups[i].params.logprobs or 0 for i in plain)
        settings = BatchSettings.of(params, lsm.shape[-1], lsm.device, seeds)
        host = pick_rows(lsm, settings, k).cpu().numpy()  # the step's one transfer
        return self._split(groups, plain, host, k)

    @staticmethod
    def _split(groups: list[SequenceGroup], plain: list[int], host: np.ndarray, k: int) -> list:
        """`sampler.pick`'s array for the active rows of `groups[i]` for i in `plain`, in that order, as
        `_pick`'s per-group tuples (None for the other groups)."""
        picks, start = [None] * len(groups), 0
        for i in plain:
            rows = host[start:start + len(groups[i].active_rows)]
            start += len(rows)
            kk = groups[i].params.logprobs or 0
            picks[i] = (rows[:, 0].astype(np.int64), rows[:, 1].astype(np.float32),
                        rows[:, 2:2 + kk].astype(np.int64), rows[:, 2 + k:2 + k + kk].astype(np.float32))
        return picks

    def _postprocess(self, group: SequenceGroup, lsm: torch.Tensor, pick) -> None:
        """Record the token `_pick` chose for each active row with its log probability and top-k (or,
        for a group whose request asked for instruments, sample and record them with those), apply stops."""
        params = group.params
        instruments = group.instruments  # None unless the request asked for one (instruments.py)
        k = params.logprobs or 0
        if instruments is not None:
            top_vals = top_idx = None
            if k:
                top_vals, top_idx = torch.topk(lsm, k, dim=-1)
                top_vals, top_idx = top_vals.cpu().numpy(), top_idx.cpu().numpy()
            instruments.before_sampling(lsm, [group.sequences[i] for i in group.active_rows])
        else:
            tokens, chosen, top_idx, top_vals = pick
        keep = []
        for row, seq_index in enumerate(group.active_rows):
            seq = group.sequences[seq_index]
            if instruments is None:
                seq.token_ids.append(int(tokens[row]))
                seq.logprobs.append(float(chosen[row]))
                if k:
                    seq.top_ids.append(top_idx[row])
                    seq.top_logprobs.append(top_vals[row])
            else:
                instruments.sample(seq, lsm, row, top_idx[row] if k else None, top_vals[row] if k else None)
            self._check_stop(seq, group)
            if not seq.is_finished:
                keep.append(row)
        if len(keep) < len(group.active_rows) and keep:
            self.runner.select(group, keep)
        group.active_rows = [group.active_rows[r] for r in keep]

    def _check_stop(self, seq: Sequence, group: SequenceGroup) -> None:
        params = group.params
        token = seq.token_ids[-1]
        before = seq.text.length
        seq.text.add(token)
        if token in params.stop_token_ids:
            seq.finish_reason = FinishReason.STOP
        elif params.stop and self._cut_at_stop(seq, params.stop, before):
            seq.finish_reason = FinishReason.STOP
        elif len(seq.token_ids) >= params.max_tokens:
            seq.finish_reason = FinishReason.LENGTH
        elif len(group.prompt_ids) + len(seq.token_ids) >= self.info.context_length:
            seq.finish_reason = FinishReason.LENGTH
        if seq.is_finished:
            seq.text.finish()

    @staticmethod
    def _cut_at_stop(seq: Sequence, stops: list[str], before: int) -> bool:
        """End the text before the first stop string that the new token completed; drop the tokens
        that start at or after the cut."""
        start = seq.text.offsets[0]  # where the generated text starts in the choice text
        text = seq.text.text
        window = max(0, before - start - max(len(s) for s in stops) + 1)
        hits = [p for p in (text.find(s, window) for s in stops) if p >= 0]
        if not hits:
            return False
        cut = min(hits)
        seq.text_end = cut
        seq.num_kept = sum(1 for off in seq.text.offsets if off < start + cut)
        return True

    def _finish(self, group: SequenceGroup) -> None:
        if group.on_finish is not None:
            try:
                group.on_finish(group)
            except Exception:  # never let a request's callback stop the loop that serves the others
                log.exception("on_finish callback failed for %s", group.request_id)


def _load_malloc_trim():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _load_malloc_trim()


def _trim_heap() -> None:
    """glibc keeps freed memory in its arenas, so a server's RSS only grows with the largest batches it
    has seen; malloc_trim returns it (a few ms, only when the engine goes idle)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _consume(fut: asyncio.Future) -> None:
    """Mark a cancelled gather's outcome as seen (asyncio logs it otherwise)."""
    if not fut.cancelled():
        fut.exception()


def _resolver(loop: asyncio.AbstractEventLoop, fut: asyncio.Future):
    def resolve(group: SequenceGroup) -> None:
        if loop.is_closed():
            return  # its requester is gone with its event loop
        def settle():
            if fut.done():
                return
            if group.error is not None:
                fut.set_exception(group.error)
            else:
                fut.set_result(group)

        loop.call_soon_threadsafe(settle)

    return resolve
