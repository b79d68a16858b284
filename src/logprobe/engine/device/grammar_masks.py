"""The grammar masks of constrained groups, computed beside the decode pass.

A constrained row's next mask (which tokens its grammar allows, and whether its text is complete)
depends only on the tokens picked so far, not on the step's logits. So the masks are computed on a
worker thread while the device runs the forward pass, and the grammar's CPU work overlaps the device's
instead of following it: llguidance releases the GIL while it walks its token trie, so the engine thread
is not slowed. The pick then reads `group.grammar_masks` (steering.py `steering_of`).

No llguidance import here: a grammar's state is made by the engine's `new_grammar_state` (engine/host/grammar.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait

from ..host.forced import sequence_constraint
from ..host.request import SequenceGroup
from .steering import grammar_rows


class GrammarMasks:
    """One engine's grammar worker: `begin` a group's grammars when it starts decoding, then each decode
    step computes its masks `beside` the forward pass and `take` hands each group its own."""

    def __init__(self):
        # made on the first constrained step: a server that never constrains starts no thread
        self._pool: ThreadPoolExecutor | None = None

    @staticmethod
    def begin(group: SequenceGroup, new_grammar_state: Callable) -> None:
        """Each choice's grammar, from `new_grammar_state(constraint)`, and its first mask. Computed
        on the engine thread: the first token is picked right after the prompt's pass, so there is no
        forward pass left to overlap."""
        for seq in group.sequences:  # a decided choice: each sequence spells its own answer (host/forced.py)
            seq.grammar = new_grammar_state(sequence_constraint(group.params.constraint, seq.index))
        group.grammar_masks = grammar_rows(group)

    @contextlib.contextmanager
    def beside(self, groups: list[SequenceGroup]) -> Iterator[dict[SequenceGroup, Future]]:
        """The next masks of the constrained groups' rows, started on the grammar thread when the block
        is entered (run the forward pass inside it). On leaving, even by an exception, every mask is
        done: no worker still reads a grammar when the step records its tokens or fails its groups."""
        pending = self._start(groups)
        try:
            yield pending
        finally:
            wait(pending.values())

    def _start(self, groups: list[SequenceGroup]) -> dict[SequenceGroup, Future]:
        constrained = [g for g in groups if g.params.constraint is not None and g.active_rows]
        if not constrained:
            return {}
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logprobe-grammar")
        return {g: self._pool.submit(grammar_rows, g) for g in constrained}

    def close(self) -> None:
        """End the worker thread (the engine's loop has stopped); a later constrained step starts another."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    @staticmethod
    def take(group: SequenceGroup, future: Future) -> None:
        """Hand a group its masks; a grammar that failed raises here, failing that group only (run it
        through the engine's per-request guard)."""
        group.grammar_masks = future.result()
