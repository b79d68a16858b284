"""Prompts prefilled in chunks on the lean runner: a long prompt takes several engine steps, so it does
not stall the decoding of others, into a per-group buffer (`PrefillState`) that moves into the KV cache's
slots when the prompt is done (`LeanRunner.expand`). Chunks of several prompts run in one pass."""

from __future__ import annotations

import torch

from ..interventions import segment_editor
from ..request import SequenceGroup
from .attention import ChunkKV, PassMeta


class PrefillState:
    """A group's prompt while it is being prefilled: keys/values so far (per layer [KV, P, d]) and its ids."""

    def __init__(self, runner, group: SequenceGroup):
        shape = (runner.kv_heads, group.num_prompt_tokens, runner.head_dim)
        self.keys = [torch.empty(shape, dtype=runner.dtype, device=runner.device) for _ in runner.layers]
        self.values = [torch.empty(shape, dtype=runner.dtype, device=runner.device) for _ in runner.layers]
        self.done = 0
        self.ids = torch.tensor(group.prompt_ids, dtype=torch.long, device=runner.device)


def prefill_chunks(runner, chunks: list[tuple[SequenceGroup, int]]) -> list[torch.Tensor | None]:
    """The next chunk of each (group, budget)'s prompt, in one forward pass: their tokens packed into
    one sequence, each attending only to its own prompt's keys so far. One read of the weights for
    all of them instead of one per prompt. Per group, the log probabilities of its first token to
    generate ([1, V]) where its prompt is done, else None."""
    parts = []  # (state, start, stop)
    for group, budget in chunks:
        if group.cache is None:
            group.cache = PrefillState(runner, group)
            if group.params.needs_prompt_logits:
                group.prompt_columns = runner.columns.new(group.num_prompt_tokens, group.params)
        state = group.cache
        parts.append((state, state.done, min(group.num_prompt_tokens, state.done + max(1, budget))))
    ids = torch.cat([state.ids[start:stop] for state, start, stop in parts])[None]
    segments, q0 = [], 0
    for (group, _), (_, start, stop) in zip(chunks, parts):
        segments.append((0, q0, q0 + stop - start, group.edits))
        q0 += stop - start
    hidden = runner.forward(ids, prepare_prefill(runner, parts), edit=segment_editor(segments))[0]  # [sum of chunks, D]
    out, finished, q0 = [], [], 0
    for (group, _), (state, start, stop) in zip(chunks, parts):
        mine = hidden[q0:q0 + stop - start]
        q0 += stop - start
        if group.prompt_columns is not None:
            runner.columns.fill(group.prompt_columns, mine, state.ids, start)
        state.done = stop
        out.append(None if stop < group.num_prompt_tokens else len(finished))
        if stop == group.num_prompt_tokens:
            finished.append(mine[-1:])
    if finished:
        logprobs = runner.logprobs_of(finished[0] if len(finished) == 1 else torch.cat(finished))
        out = [None if o is None else logprobs[o:o + 1] for o in out]
    return out


def prepare_prefill(runner, parts: list[tuple[PrefillState, int, int]]) -> PassMeta:
    """The pass of prompts' chunks (state, start, stop), packed one after another."""
    positions = torch.cat([torch.arange(start, stop, device=runner.device) for _, start, stop in parts])[None]
    if len(parts) > 1:
        masks = runner.attention.chunk_masks([(start, stop) for _, start, stop in parts])
    elif parts[0][1] == 0 and not runner.attention.window_sizes:  # a whole prompt so far: plain causal
        masks = {None: None}
    else:
        _, start, stop = parts[0]
        causal = torch.ones(stop - start, stop, dtype=torch.bool, device=runner.device).tril(start)
        masks = runner.attention.additive(runner.attention.bands(causal, start))
    return PassMeta(positions, masks, kv=ChunkKV(parts))
