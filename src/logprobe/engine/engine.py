"""The engine: the one owner of the model, and the in-process `Backend` (backend/).

A single thread runs the step loop (core.py: schedule, run, pick, record), so no two requests ever run
the model at once. The asyncio side here (`run`, `stream`) turns `GenerationRequest`s into
`SequenceGroup`s, submits them and awaits their completion; it never touches the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

from ..config import SchedulerSettings
from ..backend import (Delta, GenerationOutput, GenerationRequest, ModelInfo, StreamEnd, finished_without_forward,
                       run_to_end)
from .core import EngineCore
from .host.heap import trim_heap
from .host.kv_manager import KVManager
from .host.request import SequenceGroup
from .host.streaming import attach_releasers
from .host.tree import group_for
from .runners import lean
from .runners.model_runner import ModelRunner
from .runners.prefix_cache import PrefixCache
from ..tokens import TokenTable


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


class Engine(EngineCore):
    """A model served: its runner, tokenizer and description, the step loop's thread (EngineCore) and
    the asyncio front that requests come through."""

    def __init__(self, model, tokenizer, name: str, aliases: list[str] = (), fast: bool | None = None,
                 max_model_len: int | None = None, kv_cache_positions: int = 256, prefix_cache_mb: int = 256,
                 scheduling: SchedulerSettings = SchedulerSettings()):
        """`fast`: run the model on logprobe's own batched decode path, the lean runner (default: wherever a
        family in engine/runners/families/ runs it; why not is logged); False keeps transformers' forward with a
        cache per request.
        `max_model_len`: serve a shorter context than the model's (prompt + generated tokens), as vLLM's
        option of that name. `kv_cache_positions`: positions per slot the batched KV cache starts with
        (it doubles as sequences grow, up to the context, and returns to this size when idle).
        `prefix_cache_mb`: memory for prompt prefixes' keys and values kept across batches of prompt-only
        requests (the engine's: host/prefix_index.py, its memory runners/prefix_cache.py; 0 turns it off; the
        lean runner only).
        `scheduling`: the scheduler's budgets (config.SchedulerSettings)."""
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
        use_fast = lean.supports(model) if fast is None else fast
        grids = getattr(model, "logprobe_int4", None)
        if grids is not None and not use_fast:
            raise ValueError("4-bit decode weights need the lean runner")
        # the prefix cache: the engine's, its index read by the scheduler, its memory the lean runner's
        # (the transformers runner keeps none)
        self.prefix_cache = PrefixCache(prefix_cache_mb * 2**20) if use_fast else None
        # the KV cache manager: the engine's, which rows each running group holds where; the lean runner's
        # memory carries out its decisions (the transformers runner keeps a cache per request)
        kv = KVManager(self.info.context_length, capacity=kv_cache_positions, prefix_index=self.prefix_cache,
                       keep_generated=grids is None)
        self.runner = (lean.LeanRunner(model, grids, max_len=self.info.context_length, kv_positions=kv_cache_positions,
                                       prefix_cache=self.prefix_cache, kv=kv)
                       if use_fast else ModelRunner(model))
        self.info.quantization = "int4" if grids is not None else None
        self.info.runner = "lean" if use_fast else "transformers"
        trim_heap()  # hand back what loading and packing freed (the weights' released copies)
        super().__init__(self.runner, self.info, self.table,
                         check_ids=(tokenizer("The", add_special_tokens=True).input_ids or [0])[:4],
                         scheduling=scheduling, prefix_index=self.prefix_cache, kv=kv)
        self._thread: threading.Thread | None = None
        self._running_by_id: dict[str, list[SequenceGroup]] = {}

    @classmethod
    def from_settings(cls, settings, source, aliases: list[str],
                      scheduling: SchedulerSettings = SchedulerSettings()) -> "Engine":
        """The engine of one served model, as `logprobe serve` and a Ray replica build it: `source`
        (loader.resolve_source) loaded with the settings' dtype, device and quantization, the
        --chat-template if any, and the settings' context and cache sizes (config.Settings)."""
        from .runners import loader  # the loading code (GGUF, transformers' models) loads with a model

        model, tokenizer = loader.load(source, dtype=settings.dtype, device=settings.device,
                                       quantization=settings.quantization)
        if settings.chat_template:
            try:
                with open(settings.chat_template, encoding="utf-8") as fh:
                    tokenizer.chat_template = fh.read()
            except OSError as exc:
                raise loader.ModelLoadError(f"cannot read --chat-template: {exc.strerror}") from None
        return cls(model, tokenizer, source.name, aliases, max_model_len=settings.max_model_len or None,
                   kv_cache_positions=settings.kv_cache_positions, prefix_cache_mb=settings.prefix_cache_mb,
                   scheduling=scheduling)

    # ---- lifecycle -------------------------------------------------------------------------
    def use_prefix_cache(self, cache: PrefixCache) -> PrefixCache:
        """Put `cache` in place of the engine's prefix cache (a benchmark comparing it on and off, a test
        of a small bound), between steps: the scheduler finds prompts' hits there and the runner keeps its
        keys and values there from the next step on. Returns the one it replaced."""
        if self.prefix_cache is None:
            raise ValueError("the transformers runner keeps no prefix cache")
        replaced = self.prefix_cache
        self.prefix_cache = self.runner.prefix_cache = self.scheduler.prefix_index = self.kv.prefix_index = cache
        return replaced

    def start(self) -> None:
        if self._thread is None:
            self._stopping = False  # an engine stopped before runs again (the stop's wake-up is skipped)
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
            if not self._thread.is_alive():  # no step can still hand the grammar worker a mask
                self.grammar_masks.close()
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
        with self._submitting:  # the loop takes them together (EngineCore._add_submitted)
            for group in groups:
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

    # ---- the Backend protocol (backend/) -------------------------------------------------
    async def run(self, requests: list[GenerationRequest]) -> list[GenerationOutput]:
        """Run requests to the end: the stream without deltas, drained (backend.run_to_end)."""
        return await run_to_end(self, requests)

    async def stream(self, requests: list[GenerationRequest],
                     k: int | None) -> AsyncIterator[list[Delta] | StreamEnd]:
        """Lists of Delta as steps release tokens (each choice's with `k` alternatives), then a StreamEnd.
        With `k` None, no deltas: the StreamEnd carries every request's output, and a request that needs
        no forward pass is answered without queueing. Closing the iterator early (the client went away, a
        time-out) or cancelling the task that awaits it aborts the requests: the engine drops them before
        their next step."""
        loop = asyncio.get_running_loop()
        whole = k is None
        if whole:
            groups = {i: group_for(r, self.table) for i, r in enumerate(requests) if r.params.needs_forward}
        else:
            groups = {i: SequenceGroup.from_request(r, self.table) for i, r in enumerate(requests)}
        queue: asyncio.Queue = asyncio.Queue()
        if not whole:
            attach_releasers(list(groups.values()), k, loop, queue)
        with self._tracked(groups.values()):
            done = asyncio.gather(*self.submit(list(groups.values())))
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
                if whole:
                    yield StreamEnd.of([groups[i].output() if i in groups else finished_without_forward(r)
                                        for i, r in enumerate(requests)])
                else:
                    yield StreamEnd([g.num_prompt_tokens for g in groups.values()],
                                    [sum(len(s.token_ids) for s in g.sequences) for g in groups.values()],
                                    [g.num_cached_tokens for g in groups.values()])
            finally:
                if getter is not None and not getter.done():
                    getter.cancel()
                for group in groups.values():
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

    steps_here = True  # the Backend protocol: this process runs the steps

    def observe(self, on_step, on_failure) -> None:
        """The app's metrics, called on the engine's thread after each step and each failure."""
        self.step_observer, self.failure_observer = on_step, on_failure

    def collector(self) -> None:
        return None  # the app's metrics observe the steps themselves (`observe`)

    def stats(self) -> dict:
        return {"in_flight": self.num_in_flight, "steps": self.num_steps,
                **self.runner.cache_stats(),
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
