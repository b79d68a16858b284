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

from .row_floors import padded_queries, query_floor, short_block


@dataclass(slots=True)
class ChunkKV:
    """Prompts prefilled in chunks: each chunk's keys and values written into its group's buffers
    (`PrefillState`: per layer [KV, P, d]) at its positions. Each chunk attends on its own, over its
    buffer's first `reads[i]` positions (its chunk's end, rounded up by `Attention.aligned`),
    so a query's keys sit where they would if its prompt ran alone, whatever other chunks share the pass."""

    chunks: list[tuple]  # (PrefillState, start, stop) per prompt, in the pass's order
    reads: list[int]  # per chunk: the positions of its buffer it reads

    def exchange(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Write each chunk's keys and values; [(keys, values) [1, KV, read, d]] per chunk."""
        out, q0 = [], 0
        for (state, start, stop), read in zip(self.chunks, self.reads):
            keys, values = state.keys[layer], state.values[layer]
            keys[:, start:stop] = k[0, :, q0:q0 + stop - start]
            values[:, start:stop] = v[0, :, q0:q0 + stop - start]
            q0 += stop - start
            out.append((_read(keys, read)[None], _read(values, read)[None]))
        return out


def _read(buffer: torch.Tensor, read: int) -> torch.Tensor:
    """A buffer's first `read` positions ([KV, read, d]): a view where it holds them (positions past
    those written hold zeros or an earlier writer's keys, finite either way, and are masked), else a copy
    padded with zeros."""
    if buffer.shape[1] >= read:
        return buffer[:, :read]
    return F.pad(buffer, (0, 0, 0, read - buffer.shape[1]))


@dataclass(slots=True)
class PrefixedKV:
    """Prompts' own tokens after prefixes whose keys and values were made before (prompt_batch.py): each
    row's keys at their positions, its prefix's (0..first - 1) then its own, zeros past them up to the
    pass's read. A row's keys sit where they would if it ran alone."""

    shape: tuple  # [rows, KV, read, d]
    prefix_of: dict  # row -> (prefix length, keys per layer [KV, P, d], values per layer, hidden)
    own: tuple  # (rows, sources, targets) index tensors: row r's own token at s goes to key position t

    def exchange(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.zeros(self.shape, dtype=k.dtype, device=k.device)
        values = torch.zeros(self.shape, dtype=v.dtype, device=v.device)
        for row, (length, prefix_keys, prefix_values, _) in self.prefix_of.items():
            keys[row, :, :length] = prefix_keys[layer][:, :length]
            values[row, :, :length] = prefix_values[layer][:, :length]
        rows, sources, targets = self.own
        keys[rows, :, targets] = k[rows, :, sources]
        values[rows, :, targets] = v[rows, :, sources]
        return keys, values


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
    masks: dict | None = None  # window -> additive mask [(B, 1,) T, keys] (ChunkKV: a list, one per chunk), None: causal
    kv: ChunkKV | PrefixedKV | None = None  # None: the pass attends to its own keys and values only
    read: int | None = None  # key positions read, zeros past those held (ChunkKV: each chunk's own)
    slabs: list[SlabRows] | None = None  # a decode step: its rows slab by slab (then `masks` is unused)
    keep: Callable | None = None  # keep(layer, k, v) sees every layer's keys and values (prefix cache)
    # with 4-bit weights loaded, how many of the pass's first rows are decode rows, which read them
    # (`Linear`): every decode row, whatever the step's row count; prompt rows read the dense weights
    int4_rows: int = 0
    # a decode step and prompt chunks in one pass, packed in one row: its first `split` tokens are the
    # decode rows (attention through `slabs`), the rest the chunks (through `kv` and `masks`)
    split: int | None = None


class Attention:
    """Scaled dot-product attention of every layer, and the masks a pass's prepare step makes for it."""

    def __init__(self, windows: list[int | None], scale: float, num_heads: int, kv_heads: int, dtype, device,
                 head_dim: int | None = None):
        """`head_dim`: the size of a head, whose kernel's last short block of keys is measured on a CPU
        (row_floors.short_block; None: SHORT_BLOCK). A bfloat16 pass keeps to the float32 probes' floors
        too (row_floors.query_floor)."""
        self.windows = windows  # per layer: its sliding window, or None (full attention)
        self.window_sizes = sorted({w for w in windows if w is not None})
        self.scale, self.num_heads, self.kv_heads = scale, num_heads, kv_heads
        self.group = num_heads // kv_heads  # query heads per key/value head
        self.dtype, self.device = dtype, device
        self.floors: dict[tuple, int] = {}  # (head size, dtype) -> the kernel's query floor (`query_floor`)
        self.short_block = self.SHORT_BLOCK if head_dim is None or torch.device(device).type != "cpu" else \
            short_block(head_dim, dtype, torch.get_num_threads(), self.SHORT_BLOCK)

    def query_floor(self, q: torch.Tensor) -> int:
        """The fewest queries a block of SDPA's CPU kernel holds for a query's bits not to depend on the
        others in it, for queries like `q` (row_floors.query_floor; 1 off a CPU)."""
        key = (q.shape[-1], q.dtype)
        floor = self.floors.get(key)
        if floor is None:
            floor = self.floors[key] = query_floor(*key, torch.get_num_threads()) \
                if q.device.type == "cpu" else 1
        return floor

    # How far a pass reads keys: SDPA's CPU kernel sums whole vectors of keys and then a scalar tail, takes
    # keys in blocks of KV_BLOCK, and (float32) its product of a block's weights by the values splits a
    # block of more than SHORT_BLOCK keys and fewer than KV_BLOCK in two, at a point that moves with the
    # block's length. A key's place in those splits, and so a query's bits, would depend on how many
    # positions the longest row of its pass holds. Reads of whole READ_ALIGN positions whose last block
    # is at most SHORT_BLOCK long, or whole (every block 64-256 or 512 keys), give a query the same bits
    # at every read that holds it (`aligned`; measured by benchmarks/row_invariance.py).
    READ_ALIGN = 64
    KV_BLOCK = 512
    SHORT_BLOCK = 256
    # The oldest torch whose CPU kernel has that property (measured on 2.13 and 2.15; 2.6 gives other bits
    # for reads of 512 and in the decode layout): below it the runner warns at start.
    INVARIANT_TORCH = (2, 13)

    @classmethod
    def invariant_kernels(cls) -> bool:
        """Whether this torch's CPU attention gives a query the same bits at every read `aligned` makes."""
        return tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= cls.INVARIANT_TORCH

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
        exchanges them for: read `meta.read` positions (zeros past the pass's own), or each chunk its
        own (ChunkKV)."""
        masks = meta.masks[self.windows[layer]]
        if isinstance(meta.kv, ChunkKV):
            outs, q0 = [], 0
            for (keys, values), mask, (_, start, stop) in zip(meta.kv.exchange(layer, k, v), masks, meta.kv.chunks):
                n = stop - start
                outs.append(self.sdpa(q[:, :, q0:q0 + n], keys, values, mask))
                q0 += n
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        keys, values = (k, v) if meta.kv is None else meta.kv.exchange(layer, k, v)
        if meta.read is not None and keys.shape[2] < meta.read:
            pad = (0, 0, 0, meta.read - keys.shape[2])
            keys, values = F.pad(keys, pad), F.pad(values, pad)
        return self.sdpa(q, keys, values, masks)

    def sdpa(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
             ) -> torch.Tensor:
        """q [B, H, T, d] over keys and values [B, KV, K, d] under an additive mask ([T, K] or [B, 1, T, K];
        None: plain causal). The queries are padded where a block of the kernel's split would hold fewer
        than its floor (`query_floor`): a padded query attends as the last real one (its mask's row, or
        causally past it), and its output is dropped."""
        t = q.shape[2]
        padded = padded_queries(t, self.query_floor(q))
        if padded > t:
            q = F.pad(q, (0, 0, 0, padded - t))
            if mask is not None:
                mask = torch.cat([mask, mask[..., -1:, :].expand(*mask.shape[:-2], padded - t, mask.shape[-1])], dim=-2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                             scale=self.scale, enable_gqa=self.kv_heads != self.num_heads)
        return out if padded == t else out[:, :, :t]

    def attend_decode(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
                      ) -> torch.Tensor:
        """Decode rows' queries [n, KV, H/KV, d] (each key/value head's query heads as its queries) over
        their keys and values [n, KV, L, d] under a mask [n or 1, 1, 1, L] (None: every key seen), the
        query heads padded to the kernel's floor (`query_floor`) -> [n, KV, H/KV, d]."""
        group = q.shape[2]
        floor = self.query_floor(q)
        if group < floor:
            q = F.pad(q, (0, 0, 0, floor - group))
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)
        return out if group >= floor else out[:, :, :group]

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
            outs.append(self.attend_decode(qs.reshape(n, self.kv_heads, self.group, -1), keys, values, mask))
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

    KEY_VECTOR = 16  # keys the kernel sums as one vector: a read of whole vectors has no scalar tail

    def held(self, capacity: int) -> int:
        """The positions to hold for rows of up to `capacity` whose reads stop at the buffer's end (a row
        reads `aligned` of the longest row beside it, cut there): positions a read of which gives a
        query the bits of every longer read, the capacity where it is one (whole KEY_VECTORs, its last
        block of keys within the short block or whole), READ_ALIGN below it (an AMD EPYC with 2 threads
        gave a query of head size 256 other bits in a read of 16 keys than in longer ones), else
        `aligned(capacity)`."""
        if capacity < self.READ_ALIGN:  # a read of 16 keys of head size 256 took another path with 2 threads
            return self.READ_ALIGN
        if capacity % self.KEY_VECTOR == 0 and capacity % self.KV_BLOCK <= self.short_block:
            return capacity
        return self.aligned(capacity)

    def aligned(self, length: int) -> int:
        """The key positions a pass reads to hold `length` (those past a query's own masked): whole
        READ_ALIGN, up to the next whole KV_BLOCK where the last block would be longer than the short
        block this CPU's kernel allows (SHORT_BLOCK at most; see READ_ALIGN): 64, 128, 192, 256, 512,
        576, ..., 768, 1024, 1088, ... where it is 256."""
        read = -(-length // self.READ_ALIGN) * self.READ_ALIGN
        if read % self.KV_BLOCK > self.short_block:
            read = -(-read // self.KV_BLOCK) * self.KV_BLOCK
        return read

    def prompt_masks(self, positions: torch.Tensor, read: int) -> dict:
        """{window: additive mask} for queries at `positions` ([T], every row's; or [B, T]) over keys held at
        their own positions 0..read-1: a query at p sees the keys at p and before (after p - window in a
        sliding window's layers). [T, read], or [B, 1, T, read]."""
        columns = torch.arange(read, device=self.device)
        at = positions[..., None]
        seen = {None: columns <= at}
        for window in self.window_sizes:
            seen[window] = seen[None] & (columns > at - window)
        masks = self.additive(seen)
        return masks if positions.dim() == 1 else {w: mask[:, None] for w, mask in masks.items()}

    def own_pass(self, length: int) -> tuple[dict, int | None]:
        """(masks, read) of a pass whose rows attend to their own tokens only, from position 0. On a CPU the
        keys are read to `aligned(length)` (zeros past the pass's own), which gives a query the bits it
        has in a pass of any length, a chunk of its prompt included; on a GPU as they are (its flash
        kernels are not row-invariant either way: docs/performance.md)."""
        read = self.aligned(length) if self.device.type == "cpu" else length
        return self.causal(length, read), read

    def causal(self, length: int, read: int) -> dict:
        """{window: mask} for queries at positions 0..length-1 over keys read to `read`: plain causal attention
        (None: SDPA's is_causal, where a query i sees keys 0..i and skips the key blocks past it, so keys
        read past the pass's own are never seen; the same bits as under a mask), each sliding window's band."""
        if not self.window_sizes:
            return {None: None}
        causal = torch.ones(length, read, dtype=torch.bool, device=self.device).tril()
        return {**self.additive(self.bands(causal, 0)), None: None}

    def chunk_masks(self, spans: list[tuple[int, int]]) -> tuple[dict, list[int]]:
        """Chunks of prompts, `spans` (start, stop) of each, each attending over its own prompt's keys:
        ({window: [mask per chunk]}, the positions each chunk reads). A prompt's first chunk is plain
        causal (`causal`)."""
        reads = [self.aligned(stop) for _, stop in spans]
        masks: dict = {w: [] for w in [None, *self.window_sizes]}
        for (start, stop), read in zip(spans, reads):
            made = self.causal(stop, read) if start == 0 else \
                self.prompt_masks(torch.arange(start, stop, device=self.device), read)
            for w, mask in made.items():
                masks[w].append(mask)
        return masks, reads

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
