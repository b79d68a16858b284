"""The runner contract: everything the engine's core (core.py), the captures (captures.py), the logit
lens (prompt_columns.py) and the token trees (tree_passes.py) ask of a runner, declared once. Both
runners implement it: `lean.LeanRunner` (logprobe's own forward pass, batched decode over a KV cache in
size classes, the prefix cache) and `runner.ModelRunner` (transformers' forward, a cache per request).
The core calls nothing else on a runner and never asks what one can do (no `hasattr`): what differs is
said by `prefill_chunk_tokens` and `interleaves`.

A runner keeps its per-request state (prefill buffers, a tree's keys and values) in its own records,
keyed by the scheduler's group; the group (request.py) is written by the host side alone.
`release(group, ops)` drops that record, whatever state the group ended in. Which rows of the batched KV
cache each decoding group holds, where, and how long they are is the engine's KV cache manager's
(host/kv_manager.py): the core asks it, and hands the runner its decisions as operations (`ops`) to
carry out in order on the memory (`move`, and with `expand`, `select` and `release`). The lean runner
keeps that memory (runners/kv_cache.py) and reads the manager's layout for its decode steps; the
transformers runner keeps a cache per request and has no operation to carry out.
"""

from __future__ import annotations

from typing import Iterator, Protocol, runtime_checkable

import numpy as np
import torch

from .host.kv_manager import Op, Row
from .runners.interventions import Edits
from .runners.prefix_cache import PrefixCache
from .runners.prompt_columns import PromptColumnWriter
from .host.request import PromptColumns, SequenceGroup


@runtime_checkable
class Runner(Protocol):
    device: torch.device
    vocab_size: int
    # Prompt tokens per step beside decoding rows (the scheduler's chunk), or None: prompts prefilled whole.
    prefill_chunk_tokens: int | None
    # Whether a prompt-only pass yields between its blocks (`prompt_pass`), so that other work runs
    # between them, or runs whole.
    interleaves: bool
    # The writer of prompt columns over this runner's head (prompt_columns.py): the logit lens reads
    # a layer's positions through it.
    columns: PromptColumnWriter
    # The engine's prefix cache, whose keys and values this runner keeps (runners/prefix_cache.py; its
    # index is what the scheduler finds hits in), or None: the runner keeps none.
    prefix_cache: PrefixCache | None

    # ---- prompts ---------------------------------------------------------------------------
    def prompt_pass(self, groups: list[SequenceGroup], hits: list | None) -> Iterator[int]:
        """Prompt-only groups (max_tokens 0) in one pass that makes each one's prompt columns where it
        asks for them (`prompt_columns` hands them over), as steps: the engine advances it a step at a
        time (next()), the runner yielding where it may be paused (the padded positions a block just
        ran, 0 before a run of the head; nowhere where not `interleaves`) and the pass done when it
        stops. Between two of its steps the engine runs others (decode, prompts, other passes): the
        pass holds no state they touch.
        `hits`: per group, its longest kept prefix (with hidden states) the engine found in its prefix
        index as the pass began, or None; None for all where the engine keeps no prefix cache."""

    def prefill_chunks(self, chunks: list[tuple[SequenceGroup, int]]) -> list[torch.Tensor | None]:
        """The next chunk of each (group, budget)'s prompt; per group the log probabilities of its first
        token to generate ([1, V]) where its prompt is done, else None."""

    def start_prompt(self, group: SequenceGroup, hit, held: int) -> None:
        """The group's prompt is admitted to prefill (`prefill_chunks` runs it from the next step on), its
        first `held` tokens held by the prefix cache (`hit`, what the scheduler found in the engine's
        prefix index; None and 0 on a miss, or where the engine keeps none): the runner takes the hit's
        keys and values now, held for the group until `release`, and runs the rest. The scheduler counts
        the held tokens computed, so chunks and budgets charge only the tokens still to run."""

    def prompt_columns(self, group: SequenceGroup) -> PromptColumns | None:
        """The columns the runner made of the group's prompt (None where it asks for none), handed over
        once as the prompt is done (after `prompt_pass`, or the chunk that ends it): the host side
        writes them on the group, the runner never does."""

    def cached_tokens(self, group: SequenceGroup) -> int:
        """Tokens of the group's prompt whose keys and values the runner took from its prefix cache
        instead of computing them (0 for a runner without one); read as the prompt finishes."""

    def expand(self, group: SequenceGroup, rows: list[Row], ops: list[Op]) -> None:
        """The prompt is done and its choices go on decoding: the manager's operations that make room
        (`ops`), then each of `rows` (the manager's, one per choice) holding the prompt's keys and values."""

    # ---- decoding --------------------------------------------------------------------------
    def decode_groups(self, groups: list[SequenceGroup]) -> list[torch.Tensor]:
        """One decode step of every active row of these groups: [rows, V] per group. Every row has room
        for its next position (the core carried out the manager's `make_room` first) and the core counts
        it written after (`advance`)."""

    def decode_and_pick(self, groups: list[SequenceGroup], k: int) -> tuple[list[torch.Tensor], np.ndarray | None]:
        """`decode_groups`, and the rows' picks (sampler.pick's host array) where the runner picks them in
        its pass; None where the engine picks."""

    def decode_with_prefill(self, groups: list[SequenceGroup], chunks: list[tuple[SequenceGroup, int]]
                            ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]] | None:
        """A decode step of `groups` and the next chunk of each prompt of `chunks` in one pass:
        (`decode_groups`' answer, `prefill_chunks`' answer); None where the runner runs them apart (the
        engine then calls those two)."""

    def select(self, group: SequenceGroup, keep: list[int], ops: list[Op]) -> None:
        """Keep the group's rows at the places `keep` (the others finished): the manager's operations that
        free the others' slots."""

    def move(self, ops: list[Op]) -> None:
        """Carry out the KV cache manager's operations in order (rows kept in the prefix cache, moved into
        another class or slot, classes grown or let go)."""

    def tree_pass(self, tree, hit) -> torch.Tensor:
        """A token tree's next level (its prompt first): [rows, V] raw log probabilities. `hit`: at the
        first pass, the prompt's longest kept prefix the engine found in its prefix index (the runner
        takes its keys and values and runs the rest); None on a miss, at later passes, or where the
        engine keeps no prefix cache."""

    # ---- activations -----------------------------------------------------------------------
    def residual_stream(self, ids: list[int], layers: list[int], edits: Edits | None = None) -> dict[int, np.ndarray]:
        ...

    def logit_lens(self, ids: list[int], layers: list[int], k: int, edits: Edits | None = None
                   ) -> dict[int, PromptColumns]:
        ...

    def logprobs_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """Raw next-token log probabilities, float32, of final-norm hidden states [..., D]."""

    def apply_final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        ...

    def head_dtype(self) -> torch.dtype:
        ...

    # ---- state -----------------------------------------------------------------------------
    def release(self, group, ops: list[Op] = ()) -> None:
        """The group is done: the manager's operations that free its rows, then drop its record (buffers)
        whatever state it ended in."""

    def reset(self) -> None:
        """After a failed step: forget every record and shared state (the engine failed their groups and
        reset its KV cache manager: the memory starts afresh to match it)."""

    def is_consistent(self, running: list[SequenceGroup]) -> bool:
        """Whether the shared state holds exactly what the manager says the running groups hold."""

    def on_idle(self) -> None:
        """The engine has nothing to do (and carried out its manager's `shrink`): hand back memory a busy
        spell took."""

    def cache_stats(self) -> dict:
        """/health's and /metrics' numbers: kv_cache_bytes, prefix_cache_bytes, prefix_cache_hits,
        prefix_cache_misses, prefix_cache_tokens_saved."""
