"""The engine's side of streaming: after each step of a group, `Releaser`s (one per choice) decide, on
the engine thread, which new tokens can go out as `Delta`s (backend/).

A token is released with the text it completes. While stop strings are set, the last `longest stop - 1`
characters are held back (a stop string may still be forming), so the streamed text and tokens always
equal the answer without streaming. No torch here: the engine's test double streams with the same
releasers (tests/fake_backend.py).
"""

from __future__ import annotations

import asyncio

import numpy as np

from ...backend import Delta
from .request import RowLog, SequenceGroup, SequenceState


class Releaser:
    def __init__(self, seq: SequenceState, group: SequenceGroup, k: int, hold_chars: int, has_stops: bool = False):
        self.seq = seq
        self.group = group
        self.k = k
        self.hold = hold_chars
        self.has_stops = has_stops
        self.tokens = 0  # tokens released so far
        self.chars = 0  # characters of the generated text released so far
        self.is_first = True
        self.ended = False  # the delta with this choice's finish_reason has gone out

    def release(self, group_index: int) -> Delta | None:
        """The choice's next delta, or None when there is nothing new. The delta that carries the
        finish_reason is the last: a choice that ended while the others go on sends nothing more."""
        if self.ended:
            return None
        seq = self.seq
        text = seq.text.text
        start = seq.text.offsets[0] if seq.text.offsets else 0
        if seq.is_finished:
            upto = len(seq.token_ids) if seq.num_kept is None else seq.num_kept
            chars = len(text) if seq.text_end is None else seq.text_end
        else:
            safe = len(text) - self.hold
            upto = self.tokens
            offsets, count = seq.text.offsets, len(seq.token_ids)

            def end_of(i):  # where token i's text ends: where the next token starts
                return (offsets[i + 1] if i + 1 < count else start + len(text)) - start

            # A token goes out once its text ends in the safe part; with stop strings, it must also start
            # there: a stop string's cut drops every token that starts at or after it, an empty one (a
            # special token, a piece of a character) right where a stop string begins included.
            while upto < count and end_of(upto) <= safe and not (self.has_stops and offsets[upto] - start >= safe):
                upto += 1
            chars = end_of(upto - 1) if upto > self.tokens else self.chars
        if upto == self.tokens and chars == self.chars and not seq.is_finished and not self.is_first:
            return None
        ids, lps, top_ids, top_lps = seq.columns(self.k, self.tokens, upto)
        delta = Delta(group_index, seq.index, self.is_first, text[self.chars:chars], ids, lps,
                      top_ids, top_lps, list(seq.text.offsets[self.tokens:upto]),
                      seq.finish_reason.value if seq.is_finished else None,
                      self.group.prompt_columns if self.is_first else None)
        self.add_distribution_columns(delta, upto)
        self.tokens, self.chars, self.is_first = upto, chars, False
        self.ended = seq.is_finished
        return delta

    def add_distribution_columns(self, delta: Delta, upto: int) -> None:
        """The delta's tokens' allowed log mass (a masked request) and processed columns ("both")."""
        params, log, start = self.group.params, self.seq.rows or RowLog(), self.tokens
        if params.logprobs is None:
            return
        if params.is_masked:
            delta.constraint_logprobs = np.asarray(log.constraint_logprobs[start:upto], dtype=np.float32)
        if params.logprobs_mode == "both":
            num, k = upto - start, self.k
            delta.processed_logprobs = np.asarray(log.processed_logprobs[start:upto], dtype=np.float32)
            delta.processed_top_logprobs = (np.stack(log.processed_top_logprobs[start:upto])[:, :k] if num and k
                                            else np.zeros((num, k), dtype=np.float32))
            delta.processed_top_ids = (np.stack(log.processed_top_ids[start:upto])[:, :k]
                                       if num and k and log.processed_top_ids else delta.top_ids)


def releasers_of(group: SequenceGroup, k: int) -> list[Releaser]:
    """One releaser per choice of the group; `k`: the top-k width its deltas carry."""
    stops = group.params.stop
    hold = max((len(s) for s in stops), default=1) - 1
    return [Releaser(seq, group, k, hold, bool(stops)) for seq in group.sequences]


def release_all(releasers: list[Releaser], group_index: int) -> list[Delta]:
    """The deltas the group's last step released, at most one per choice."""
    return [d for d in (r.release(group_index) for r in releasers) if d is not None]


def attach_releasers(groups: list[SequenceGroup], k: int, loop: asyncio.AbstractEventLoop,
                     queue: asyncio.Queue) -> None:
    """Set each group's on_step to release its choices' new tokens into `queue` (as lists of Delta)."""
    for g_index, group in enumerate(groups):
        releasers = releasers_of(group, k)

        def on_step(group, releasers=releasers, g_index=g_index):
            deltas = release_all(releasers, g_index)
            if deltas and not loop.is_closed():
                loop.call_soon_threadsafe(queue.put_nowait, deltas)

        group.on_step = on_step
