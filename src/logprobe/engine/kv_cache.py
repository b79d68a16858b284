"""A preallocated KV cache of slots, one slot per running sequence, for batched decoding.

Layout per layer: keys and values `[S, KV, T, D]` (slots, kv heads, positions, head dim). Used slots are
kept contiguous (0..num_used-1): a freed slot is filled by moving the last one into it, so a decode step
attends over the plain view `[:num_used, :, :longest]` with a length mask, without gathering.

Every method runs under `torch.inference_mode()`, whoever calls it: the cache is grown inside decode
steps (inference mode) and written when a prompt's rows join (which may run outside it), and an
inference tensor cannot be updated in place outside inference mode. A method either completes or leaves
the cache as it was (a row joins the bookkeeping only once its keys and values are written).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Row:
    """One decoding sequence's handle on the cache; `slot` changes when slots are compacted."""

    group: object
    seq_index: int
    slot: int = -1
    length: int = 0  # positions written


class SlotCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype, device, max_len: int,
                 slots: int = 4, capacity: int = 256):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device, self.max_len = dtype, device, max_len
        self.rows: list[Row] = []
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._initial = (slots, min(capacity, max_len))
        self._allocate(*self._initial)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    @torch.inference_mode()
    def shrink(self) -> None:
        """Back to the initial size when no slot is used (the cache only grows while busy)."""
        if not self.rows and (self.num_slots, self.capacity) != self._initial:
            self._allocate(*self._initial)  # nothing to copy: no slot is used

    @property
    def num_slots(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @torch.inference_mode()
    def _allocate(self, slots: int, capacity: int) -> None:
        shape = (slots, self.kv_heads, capacity, self.head_dim)
        new_k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        new_v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        if self.keys:  # grow: keep what the used slots hold
            used, cap = len(self.rows), min(self.capacity, capacity)
            for layer in range(self.num_layers):
                new_k[layer][:used, :, :cap] = self.keys[layer][:used, :, :cap]
                new_v[layer][:used, :, :cap] = self.values[layer][:used, :, :cap]
        self.keys, self.values = new_k, new_v

    def is_consistent(self) -> bool:
        """Whether the bookkeeping is whole: slots 0..n-1 used by the n rows, in order, within capacity."""
        return all(row.slot == i and 0 <= row.length <= self.capacity for i, row in enumerate(self.rows)) and \
            len(self.rows) <= self.num_slots

    @torch.inference_mode()
    def reserve(self, extra_rows: int, length: int) -> None:
        """Room for `extra_rows` more slots and `length` positions in every slot."""
        slots, capacity = self.num_slots, self.capacity
        if len(self.rows) + extra_rows > slots:
            slots = max(len(self.rows) + extra_rows, 2 * slots)
        if length > capacity:
            capacity = min(self.max_len, max(length, 2 * capacity))
        if (slots, capacity) != (self.num_slots, self.capacity):
            self._allocate(slots, capacity)

    @torch.inference_mode()
    def add(self, row: Row, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Give `row` the next slot, filled with a prefilled sequence's [KV, P, D] keys and values."""
        length = keys[0].shape[1]
        self.reserve(1, length + 1)
        slot = len(self.rows)
        for layer in range(self.num_layers):
            self.keys[layer][slot, :, :length] = keys[layer]
            self.values[layer][slot, :, :length] = values[layer]
        row.slot, row.length = slot, length
        self.rows.append(row)

    @torch.inference_mode()
    def remove(self, row: Row) -> None:
        """Free a row's slot; the last used slot moves into it so the used ones stay contiguous."""
        slot, last = row.slot, len(self.rows) - 1
        moved = self.rows[last]
        if slot != last:
            n = moved.length
            for layer in range(self.num_layers):
                self.keys[layer][slot, :, :n] = self.keys[layer][last, :, :n]
                self.values[layer][slot, :, :n] = self.values[layer][last, :, :n]
            moved.slot = slot
            self.rows[slot] = moved
        self.rows.pop()
        row.slot = -1
