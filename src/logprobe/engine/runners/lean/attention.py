"""Attention on the lean runner. Each pass of the blocks is described by one `PassMeta`, made by that
kind of pass's prepare step: the positions, where each layer's keys and values go and which it reads
(the key/value layout), and one mask per attention window (full attention, and each sliding window the
model has). One `Attention.__call__(layer, q, k, v, meta)` serves every pass.

Masks reach SDPA additive, made once per pass (`Attention.additive`). There are two SDPA call sites,
one per layout of the queries: passes over prompt tokens (several queries per row, SDPA's
`enable_gqa`), and decode steps (one query per row, each key/value head's query heads as its queries).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class ChunkKV:
    """Prompts prefilled in chunks: each chunk's keys and values written into its group's buffers
    (`PrefillState`: per layer [KV, P, d]) at its positions; the pass attends over each buffer up to
    its chunk's end, prompts one after another (the mask keeps each to its own)."""

    chunks: list[tuple]  # (PrefillState, start, stop) per prompt, in the pass's order

    def exchange(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.chunks) == 1:  # a view of the buffer, no copy
            state, start, stop = self.chunks[0]
            state.keys[layer][:, start:stop] = k[0]
            state.values[layer][:, start:stop] = v[0]
            return state.keys[layer][None, :, :stop], state.values[layer][None, :, :stop]
        q0 = 0
        for state, start, stop in self.chunks:
            state.keys[layer][:, start:stop] = k[0, :, q0:q0 + stop - start]
            state.values[layer][:, start:stop] = v[0, :, q0:q0 + stop - start]
            q0 += stop - start
        keys = torch.cat([state.keys[layer][:, :stop] for state, _, stop in self.chunks], dim=1)[None]
        values = torch.cat([state.values[layer][:, :stop] for state, _, stop in self.chunks], dim=1)[None]
        return keys, values


@dataclass(slots=True)
class PrefixedKV:
    """Prompts' own tokens after prefixes whose keys and values were made before (prompt_batch.py): per
    row, its prefix's keys in front of its own (zeros, masked, past a shorter prefix or for none)."""

    shape: tuple  # of the prefix part: [rows, KV, longest prefix, d]
    prefix_of: dict  # row -> (prefix length, keys per layer [KV, P, d], values per layer, hidden)

    def exchange(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        prefix_k = torch.zeros(self.shape, dtype=k.dtype, device=k.device)
        prefix_v = torch.zeros(self.shape, dtype=v.dtype, device=v.device)
        for row, (length, keys, values, _) in self.prefix_of.items():
            prefix_k[row, :, :length] = keys[layer]
            prefix_v[row, :, :length] = values[layer]
        return torch.cat([prefix_k, k], dim=2), torch.cat([prefix_v, v], dim=2)


@dataclass(slots=True)
class SlabRows:
    """Decode rows held in one slab of the KV cache (kv_cache.py), one new token each: its key and value
    written at the row's position, attention over the slab's first `read` positions."""

    keys: list[torch.Tensor]  # the slab's, per layer [S, KV, capacity, d]
    values: list[torch.Tensor]
    rows: slice | None  # this slab's rows of the batch; None: all of them
    num_rows: int
    positions: torch.Tensor | None  # [n] where each row writes; None: every row at read - 1 (one copy)
    slots: torch.Tensor | None  # [n] the rows' slots, for the scatter (None with positions)
    read: int  # positions read
    views: dict  # window -> (first position read, additive mask [n or 1, 1, 1, read - first] or None)
    at: int | None = None  # with positions None: where every row writes (None: read - 1)


@dataclass(slots=True)
class PassMeta:
    """One pass of the blocks besides its tokens: made by the pass's prepare step, read by `Attention`."""

    positions: torch.Tensor  # [B, T]: each token's position (RoPE, interventions)
    masks: dict | None = None  # window -> additive mask [(B, 1,) T, keys], or None: plain causal
    kv: ChunkKV | PrefixedKV | None = None  # None: the pass attends to its own keys and values only
    slabs: list[SlabRows] | None = None  # a decode step: its rows slab by slab (then `masks` is unused)
    keep: Callable | None = None  # keep(layer, k, v) sees every layer's keys and values (prefix cache)
    few_rows: bool = False  # a decode step small enough for the 4-bit weights
    # a decode step and prompt chunks in one pass, packed in one row: its first `split` tokens are the
    # decode rows (attention through `slabs`), the rest the chunks (through `kv` and `masks`)
    split: int | None = None


class Attention:
    """Scaled dot-product attention of every layer, and the masks a pass's prepare step makes for it."""

    def __init__(self, windows: list[int | None], scale: float, num_heads: int, kv_heads: int, dtype, device):
        self.windows = windows  # per layer: its sliding window, or None (full attention)
        self.window_sizes = sorted({w for w in windows if w is not None})
        self.scale, self.num_heads, self.kv_heads = scale, num_heads, kv_heads
        self.group = num_heads // kv_heads  # query heads per key/value head
        self.dtype, self.device = dtype, device

    FEW_QUERIES = 32  # a pass of one row and at most this many queries attends in the decode step's layout
    # Keys are read in spans of whole multiples of this many positions, those past a query's own masked:
    # SDPA's CPU kernel sums full vectors of keys and a scalar tail, so a key's place in that split (and
    # the query's bits) would otherwise depend on how many positions the longest row of its batch holds.
    READ_ALIGN = 64

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PassMeta) -> torch.Tensor:
        """q [B, H, T, d], k and v [B, KV, T, d] of this pass's tokens -> [B, H, T, d]."""
        if meta.keep is not None:
            meta.keep(layer, k, v)
        if meta.split is not None:  # decode rows, then prompt chunks, packed in one row
            r = meta.split
            rows = self.attend_rows(layer, q[0, :, :r, None].transpose(0, 1), k[0, :, :r, None].transpose(0, 1),
                                    v[0, :, :r, None].transpose(0, 1), meta.slabs)  # [R, H, 1, d]
            prompts = self.attend_prompt(layer, q[:, :, r:], k[:, :, r:], v[:, :, r:], meta)
            return torch.cat([rows[:, :, 0].transpose(0, 1)[None], prompts], dim=2)
        if meta.slabs is not None:
            return self.attend_rows(layer, q, k, v, meta.slabs)
        return self.attend_prompt(layer, q, k, v, meta)

    def attend_prompt(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PassMeta
                      ) -> torch.Tensor:
        """Queries of prompt tokens (several a row) over the pass's keys and values, or those `meta.kv`
        exchanges them for."""
        keys, values = (k, v) if meta.kv is None else meta.kv.exchange(layer, k, v)
        mask = meta.masks[self.windows[layer]]
        b, _, t, d = q.shape
        if b == 1 and t <= self.FEW_QUERIES and self.group > 1 and \
                ((mask is None and t == keys.shape[2] == 1) or (mask is not None and mask.dim() == 2)):
            # A few queries (a prompt's last tokens after a kept prefix): each key/value head's query heads
            # as its queries, as in a decode step, without enable_gqa's copy of every key and value.
            grouped = q.reshape(1, self.kv_heads, self.group * t, d)
            out = F.scaled_dot_product_attention(grouped, keys, values, scale=self.scale,
                                                 attn_mask=None if mask is None else mask.repeat(self.group, 1))
            return out.reshape(1, self.num_heads, t, d)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                              scale=self.scale, enable_gqa=self.kv_heads != self.num_heads)

    def attend_rows(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slabs: list[SlabRows]
                    ) -> torch.Tensor:
        """A decode step: each row's key and value into its slab, its one query over the slab's view.
        Each key/value head's query heads attend as that head's queries ([n, KV, H/KV, d] against
        [n, KV, L, d]): the same products as enable_gqa without its expansion of the keys, which in
        bfloat16 cost 10x (0.78 vs 0.08 ms for 16 rows of 80 positions, 7.4 vs 0.53 ms for 600: 4 query
        heads on 1 key head, d 256)."""
        window, outs = self.windows[layer], []
        for part in slabs:
            n = part.num_rows
            qs, ks, vs = (q, k, v) if part.rows is None else (q[part.rows], k[part.rows], v[part.rows])
            keys, values = part.keys[layer][:n], part.values[layer][:n]
            if part.positions is None:  # ks, vs [n, KV, 1, d] go to the one position every row is at
                at = part.read - 1 if part.at is None else part.at
                keys.narrow(2, at, 1).copy_(ks)
                values.narrow(2, at, 1).copy_(vs)
            else:
                keys[part.slots, :, part.positions] = ks[:, :, 0]
                values[part.slots, :, part.positions] = vs[:, :, 0]
            first, mask = part.views[window]
            keys, values = keys.narrow(2, first, part.read - first), values.narrow(2, first, part.read - first)
            outs.append(F.scaled_dot_product_attention(qs.reshape(n, self.kv_heads, self.group, -1), keys, values,
                                                       attn_mask=mask, scale=self.scale))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.reshape(q.shape[0], self.num_heads, 1, -1)

    # ---- masks (True: seen) ------------------------------------------------------------------------
    def bands(self, causal: torch.Tensor, first: int) -> dict:
        """{window: mask} for a causal mask [Q, K] whose query i sits at position first + i over keys at
        positions 0..K-1: the causal mask with keys at or before p - window dropped. `None` maps to the
        causal mask itself (full-attention layers)."""
        masks = {None: causal}
        for window in self.window_sizes:
            masks[window] = causal.triu(first - window + 1)
        return masks

    def additive(self, masks: dict) -> dict:
        """Boolean masks (True: seen) as the additive masks SDPA makes of them (0 where seen, -inf
        elsewhere, in the queries' dtype), made once per pass: given a boolean mask, SDPA converts it on
        every call, once per layer (a kernel per layer on a GPU, inside the recorded decode step too).
        The same numbers bit for bit. None stays None; a mask that several keys share is made once."""
        # (boolean, additive) pairs, found with `is` rather than id(), which torch.compile cannot trace
        made: list[tuple[torch.Tensor, torch.Tensor]] = []
        out = {}
        for key, mask in masks.items():
            if mask is not None:
                additive = None
                for seen, add in made:
                    if seen is mask:
                        additive = add
                if additive is None:
                    additive = torch.zeros(mask.shape, dtype=self.dtype, device=mask.device).masked_fill_(
                        ~mask, float("-inf"))
                    made.append((mask, additive))
                mask = additive
            out[key] = mask
        return out

    def causal_masks(self, length: int) -> dict:
        """A pass over positions 0..length-1 of its own tokens: plain causal attention (None: SDPA's
        is_causal, which lets it take its flash kernels on a GPU), each sliding window's band."""
        if not self.window_sizes:
            return {None: None}
        causal = torch.ones(length, length, dtype=torch.bool, device=self.device).tril()
        masks = self.additive(self.bands(causal, 0))
        masks[None] = None
        return masks

    def chunk_masks(self, spans: list[tuple[int, int]]) -> dict:
        """Chunks of prompts packed into one sequence, `spans` (start, stop) of each: every chunk's
        queries see its own prompt's keys up to themselves, a block-diagonal causal mask."""
        num_queries, num_keys = sum(stop - start for start, stop in spans), sum(stop for _, stop in spans)
        masks = {w: torch.zeros(num_queries, num_keys, dtype=torch.bool, device=self.device)
                 for w in [None, *self.window_sizes]}
        q0 = k0 = 0
        for start, stop in spans:
            n = stop - start
            blocks = self.bands(torch.ones(n, stop, dtype=torch.bool, device=self.device).tril(start), start)
            for w, mask in masks.items():
                mask[q0:q0 + n, k0:k0 + stop] = blocks[w]
            q0, k0 = q0 + n, k0 + stop
        return self.additive(masks)

    def row_masks(self, seen: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor) -> dict:
        """Per-row masks [B, 1, T, keys] from what each query sees under full attention, `seen` [B, T, keys],
        with each sliding window's band from the queries' positions [B, T, 1] and the keys' [B, 1, keys]."""
        masks = {None: seen[:, None]}
        for window in self.window_sizes:
            masks[window] = (seen & (query_positions - key_positions < window))[:, None]
        return self.additive(masks)

    def step_views(self, position: int, read: int) -> dict:
        """`decode_views` for rows that are all at `position`, reading `read` positions from 0: one mask
        [1, 1, 1, read] they share (None where nothing past the position is read and no window masks)."""
        if position == read - 1 and not self.window_sizes:
            return {None: (0, None)}
        columns = torch.arange(read, device=self.device)
        seen = {None: (columns <= position)[None, None, None]}
        for window in self.window_sizes:
            seen[window] = seen[None] & (columns > position - window)[None, None, None]
        return {w: (0, mask) for w, mask in self.additive(seen).items()}

    def decode_views(self, positions: torch.Tensor | None, read: int) -> dict:
        """{window: (first position read, additive mask [n, 1, 1, read - first] or None)} for decode rows
        of one slab at `positions` [n] reading its first `read` positions; positions None: every row is
        at read - 1, so a row sees every position read (full attention) or exactly the last `window`."""
        if positions is None:
            return {None: (0, None), **{w: (max(0, read - w), None) for w in self.window_sizes}}
        columns = torch.arange(read, device=self.device)[None, :]
        mask = (columns <= positions[:, None])[:, None, None, :]
        views = {None: (0, mask)}
        for window in self.window_sizes:
            if read <= window:  # no row is past the window yet
                views[window] = (0, mask)
            else:
                views[window] = (0, mask & (columns > (positions - window)[:, None])[:, None, None, :])
        masks = self.additive({w: mask for w, (_, mask) in views.items()})
        return {w: (first, masks[w]) for w, (first, _) in views.items()}
