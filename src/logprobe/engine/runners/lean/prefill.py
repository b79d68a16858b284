"""Prompts prefilled in chunks on the lean runner: a long prompt takes several engine steps, so it does
not stall the decoding of others, into a per-group store (`PrefillState`) that moves into the KV cache's
slots when the prompt is done (`LeanRunner.expand`). Chunks of several prompts run in one pass. A prompt
starts after the longest prefix the prefix cache holds of it, and leaves its own whole blocks there."""

from __future__ import annotations

import torch

from ..interventions import segment_editor
from ...host.prefix_index import BLOCK, Hit, grown, uses_prefix_cache
from ..prefix_cache import Store
from ...host.request import SequenceGroup
from .attention import ChunkKV, PassMeta


class PrefillState:
    """A group's prompt while it is being prefilled: its keys and values so far (per layer [KV, >= P, d])
    and final hidden states, in a prefix-cache `Store` (prefix_cache.py); its ids. A prompt that begins
    with a kept prefix starts after it (`done`): it writes on in the kept store where it extends the
    store's longest entry and the store has room (`claim`), else into a store of its own holding a copy
    of the prefix. Its whole blocks are kept when the prompt is done (`keep`)."""

    def __init__(self, runner, group: SequenceGroup, found: tuple[Hit | None, int] | None = None):
        """`found`: (the hit, the tokens held) the scheduler found as it admitted the prompt
        (PrefixIndex.start); None: found here (a caller without the scheduler: tests, benchmarks)."""
        num, ids = group.num_prompt_tokens, group.prompt_ids
        cache = runner.prefix_cache
        self.cached = cache.enabled and uses_prefix_cache(group.params)  # uses and fills the prefix cache
        if found is None:
            found = cache.start(ids, group.params.needs_prompt_logits) if self.cached else (None, 0)
        # start: after the hit and the tokens written past its entry by the request before (a client
        # loop's previous call)
        hit, start = found
        # whether the kept positions it starts after have their hidden states kept
        self.hidden_valid = hit is None or (hit.has_hidden and (start == hit.length or hit.entry.store.tail[1]))
        store = cache.claim(hit, num, self) if hit is not None else None
        if store is None:
            # whole READ_ALIGN positions: a chunk reads its store to its end rounded up (attention.ChunkKV;
            # a read past the capacity is a padded copy)
            align = runner.attention.READ_ALIGN
            capacity = -(-(grown(num) if hit is not None and hit.extends else num) // align) * align
            store = Store.empty(len(runner.layers), runner.kv_heads, runner.head_dim, runner.hidden_size,
                                capacity, runner.dtype, runner.device)
            store.writer = self
            if hit is not None:
                kept = hit.entry.store
                for layer in range(len(runner.layers)):
                    store.keys[layer][:, :start] = kept.keys[layer][:, :start]
                    store.values[layer][:, :start] = kept.values[layer][:, :start]
                if self.hidden_valid:
                    store.hidden[:start] = kept.hidden[:start]
        self.store, self.hit = store, hit
        self.keys, self.values = store.keys, store.values
        self.done = start
        self.begun = False  # whether a chunk has run (the first makes the prompt's columns)
        self.ids = torch.tensor(ids, dtype=torch.long, device=runner.device)
        self.prompt_ids = ids

    def write_hidden(self, hidden: torch.Tensor, start: int) -> None:
        if self.store.hidden is not None and self.hidden_valid:
            self.store.hidden[start:start + hidden.shape[0]] = hidden

    def keep(self, cache) -> None:
        """The prompt is done: its whole blocks go into the prefix cache, on this store (no copy)."""
        ids, hit = self.prompt_ids, self.hit
        if not self.cached:
            return
        whole = len(ids) // BLOCK * BLOCK
        if hit is None or whole > hit.length:
            cache.adopt(ids, self.store, len(ids) if self.hidden_valid else 0)
        elif hit.extends and self.store is not hit.entry.store:  # a copy with room: the next call writes on in it
            cache.adopt(ids, self.store, len(ids) if self.hidden_valid else 0, replace=True)

    def release(self, cache) -> None:
        """Done writing (its keys moved into the KV cache, or the group left): another may write past
        the store's frontier, and one that goes on with the same tokens starts after those written."""
        cache.release(self.store, self, self.prompt_ids, self.done, self.hidden_valid and self.store.hidden is not None)


def prefill_chunks(runner, chunks: list[tuple[SequenceGroup, int]]) -> list[torch.Tensor | None]:
    """The next chunk of each (group, budget)'s prompt, in one forward pass: their tokens packed into
    one sequence, each attending only to its own prompt's keys so far. One read of the weights for
    all of them instead of one per prompt. Per group, the log probabilities of its first token to
    generate ([1, V]) where its prompt is done, else None."""
    parts, ids, segments = begin_chunks(runner, chunks)
    hidden = runner.forward(ids, prepare_prefill(runner, parts), edit=segment_editor(segments))[0]  # [sum of chunks, D]
    out, finished = finish_chunks(runner, chunks, parts, hidden)
    if finished:
        logprobs = runner.logprobs_of(finished[0] if len(finished) == 1 else torch.cat(finished))
        out = [None if o is None else logprobs[o:o + 1] for o in out]
    return out


def begin_chunks(runner, chunks: list[tuple[SequenceGroup, int]]) -> tuple[list, torch.Tensor, list]:
    """Each (group, budget)'s next chunk: (parts (state, start, stop), their ids packed [1, C], the
    interventions' segments of the packed row). A group's state was made when it was admitted
    (`LeanRunner.start_prompt`: after its longest kept prefix); its first chunk makes its prompt columns
    (the kept prefix's filled from its hidden states)."""
    parts = []  # (state, start, stop)
    for group, budget in chunks:
        state = runner.prefill_state(group)
        if state is None:  # a caller that runs chunks without the scheduler's admission (tests, benchmarks)
            runner.start_prompt(group)
            state = runner.prefill_state(group)
        if not state.begun:
            state.begun = True
            if group.params.needs_prompt_logits:
                columns = runner.record(group).columns = runner.columns.new(group.num_prompt_tokens, group.params)
                if state.done:  # the kept prefix's own columns, from its hidden states
                    runner.columns.fill(columns, state.store.hidden[:state.done], state.ids, 0)
        parts.append((state, state.done, min(group.num_prompt_tokens, state.done + max(1, budget))))
    ids = torch.cat([state.ids[start:stop] for state, start, stop in parts])[None]
    segments, q0 = [], 0
    for (group, _), (_, start, stop) in zip(chunks, parts):
        segments.append((0, q0, q0 + stop - start, group.edits))
        q0 += stop - start
    return parts, ids, segments


def finish_chunks(runner, chunks, parts, hidden: torch.Tensor) -> tuple[list[int | None], list[torch.Tensor]]:
    """After the pass (`hidden`: [C, D] of the packed chunks): each chunk's prompt columns (the runner's
    record of the group holds them) and hidden states written, a finished prompt's blocks kept. (per chunk: None, or the index of its last hidden
    state in `finished`; finished: [1, D] each, for the head)."""
    out, finished, q0 = [], [], 0
    for (group, _), (state, start, stop) in zip(chunks, parts):
        mine = hidden[q0:q0 + stop - start]
        q0 += stop - start
        columns = runner.record(group).columns
        if columns is not None:
            runner.columns.fill(columns, mine, state.ids, start)
        state.write_hidden(mine, start)
        state.done = stop
        out.append(None if stop < group.num_prompt_tokens else len(finished))
        if stop == group.num_prompt_tokens:
            finished.append(mine[-1:])
            state.keep(runner.prefix_cache)
    return out, finished


def prepare_prefill(runner, parts: list[tuple[PrefillState, int, int]]) -> PassMeta:
    """The pass of prompts' chunks (state, start, stop), packed one after another, each attending over
    its own prompt's keys (`Attention.chunk_masks`)."""
    positions = torch.cat([torch.arange(start, stop, device=runner.device) for _, start, stop in parts])[None]
    masks, reads = runner.attention.chunk_masks([(start, stop) for _, start, stop in parts])
    return PassMeta(positions, masks, kv=ChunkKV(parts, reads))
