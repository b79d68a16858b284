"""A preallocated KV cache for batched decoding, in size classes: its memory follows the positions held,
not the number of sequences times the longest one.

A class ("slab") per capacity `initial * 2**i` (capped at the context length) holds the rows whose length
fits it: per layer, keys and values `[S, KV, capacity, D]` (slots, kv heads, positions, head dim). A row
enters the smallest class with room for its prompt and one more position; a row that fills its class
moves into the next one (its keys and values copied once). A row's class is at most twice its length
(or the first class), and a slab left without rows is dropped at once (but the first class's, where new
prompts go: it goes back to its initial slots at the next decode step), so the cache holds at most about
twice the positions its rows hold, plus each slab's spare slots (a slab's slots double when it is
full). Used slots are kept contiguous within a slab (0..n-1): a freed slot is filled by moving the
slab's last row into it, so a decode step attends over each slab's plain view `[:n, :, :longest]` with
a length mask, without gathering.

Every method runs under `torch.inference_mode()`, whoever calls it: the cache is grown inside decode
steps (inference mode) and written when a prompt's rows join (which may run outside it), and an
inference tensor cannot be updated in place outside inference mode. A method either completes or leaves
the cache as it was (a row joins the bookkeeping only once its keys and values are written, and a slab
is replaced only once its new tensors hold everything).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Row:
    """One decoding sequence's handle on the cache: its class (`slab`, a capacity) and `slot` in it
    change when it moves to a larger class or when its slab's slots are compacted."""

    group: object
    seq_index: int
    slot: int = -1
    length: int = 0  # positions written
    slab: int = 0  # the capacity of the class holding it (0: none)


class Slab:
    """The rows of one capacity class, in slots 0..len(rows)-1 of its per-layer keys and values."""

    __slots__ = ("capacity", "keys", "values", "rows")

    def __init__(self, capacity: int, keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.capacity = capacity
        self.keys, self.values = keys, values  # per layer: [S, KV, capacity (or more: SlabCache.positions), D]
        self.rows: list[Row] = []

    @property
    def num_slots(self) -> int:
        return self.keys[0].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


class SlabCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype, device, max_len: int,
                 slots: int = 4, capacity: int = 256, positions=None):
        """`positions(capacity)`: the positions a class's keys and values hold, `capacity` or more (the
        lean runner's on a CPU: `Attention.held`, positions whose read gives a row the bits of any longer
        read, where rows' reads stop at the slab's end; None: `capacity`)."""
        self.positions = positions or (lambda capacity: capacity)
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device, self.max_len = dtype, device, max_len
        self._initial = (slots, min(capacity, max_len))  # the first class's slots and capacity
        # capacity -> slab, in ascending capacity; replaced (never changed in place) when a slab joins or
        # leaves, so a reader on another thread (the engine's stats) iterates a whole one
        self.slabs: dict[int, Slab] = {self._initial[1]: Slab(self._initial[1], *self._zeros(*self._initial))}

    @property
    def nbytes(self) -> int:
        """Bytes allocated (every slab's keys and values, spare slots included)."""
        return sum(slab.nbytes for slab in self.slabs.values())

    @property
    def rows(self) -> tuple[Row, ...]:
        """Every row, slab by slab in ascending capacity, in slot order within a slab."""
        return tuple(row for slab in self.slabs.values() for row in slab.rows)

    @property
    def num_rows(self) -> int:
        return sum(len(slab.rows) for slab in self.slabs.values())

    def class_for(self, length: int) -> int:
        """The smallest capacity class with room for `length` positions (the context length at most)."""
        capacity = self._initial[1]
        while capacity < length and capacity < self.max_len:
            capacity *= 2
        return min(capacity, self.max_len)

    @torch.inference_mode()
    def shrink(self) -> None:
        """Drop every slab that holds no row; with no row held, back to the initial state (the cache only
        grows while busy)."""
        slots, capacity = self._initial
        if not self.num_rows:
            slab = self.slabs.get(capacity)
            if len(self.slabs) != 1 or slab is None or slab.num_slots != slots:
                self.slabs = {capacity: Slab(capacity, *self._zeros(slots, capacity))}
        elif any(not slab.rows for slab in self.slabs.values()):
            self.slabs = {c: slab for c, slab in self.slabs.items() if slab.rows}

    def is_consistent(self) -> bool:
        """Whether the bookkeeping is whole: in every slab, slots 0..n-1 used by its n rows, in order, each
        row within the slab's capacity and naming it; slabs in ascending capacity; no row held twice."""
        capacities = list(self.slabs)
        if capacities != sorted(capacities):
            return False
        for capacity, slab in self.slabs.items():
            shape = (slab.num_slots, self.kv_heads, self.positions(capacity), self.head_dim)
            if slab.capacity != capacity or len(slab.rows) > slab.num_slots or \
                    any(tuple(t.shape) != shape for t in slab.keys + slab.values):
                return False
            if not all(row.slab == capacity and row.slot == i and 0 <= row.length <= capacity
                       for i, row in enumerate(slab.rows)):
                return False
        return len({id(row) for row in self.rows}) == self.num_rows

    def holds(self, row: Row) -> bool:
        """Whether `row` is where its handle says: in slot `row.slot` of the slab of class `row.slab`."""
        slab = self.slabs.get(row.slab)
        return slab is not None and 0 <= row.slot < len(slab.rows) and slab.rows[row.slot] is row

    @torch.inference_mode()
    def add(self, rows: list[Row], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Give each of `rows` (a prompt's choices) a slot in the smallest class with room for a prefilled
        sequence's [KV, P, D] keys and values and one more position, each filled with them (the class's
        slab grows once for all of them, if it must)."""
        length, count = keys[0].shape[1], len(rows)
        capacity = self.class_for(length + 1)
        new_keys, new_values, first = self._room(capacity, count)
        for layer in range(self.num_layers):
            new_keys[layer][first:first + count, :, :length] = keys[layer]
            new_values[layer][first:first + count, :, :length] = values[layer]
        slab = self._install(capacity, new_keys, new_values)
        for i, row in enumerate(rows):
            row.slab, row.slot, row.length = capacity, first + i, length
            slab.rows.append(row)

    @torch.inference_mode()
    def make_room(self) -> None:
        """Room for one more position in every row: each row whose class is full moves into the next
        class (its keys and values copied once; a slab it enters grows first, if it must). Then the
        first class, once its rows have all left, goes back to its initial slots."""
        moving = [row for slab in self.slabs.values() for row in slab.rows if row.length >= slab.capacity]
        if moving:
            self._move_up(moving)
        slots, capacity = self._initial
        slab = self.slabs.get(capacity)
        if slab is not None and not slab.rows and slab.num_slots > slots:
            slab.keys, slab.values = self._zeros(slots, capacity)

    def _move_up(self, moving: list[Row]) -> None:
        """Move each of `moving` (full rows) into the next class: every copy first, then the bookkeeping."""
        entering: dict[int, list[Row]] = {}
        for row in moving:
            capacity = self.class_for(row.length + 1)
            if capacity <= row.slab:
                raise RuntimeError(f"a row of {row.length} positions is at the context length ({self.max_len})")
            entering.setdefault(capacity, []).append(row)
        # first every copy, into slots no row uses yet or into new tensors: the cache is unchanged so far
        staged = {}
        for capacity, rows in entering.items():
            new_keys, new_values, first = self._room(capacity, len(rows))
            for i, row in enumerate(rows):
                source, n = self.slabs[row.slab], row.length
                for layer in range(self.num_layers):
                    new_keys[layer][first + i, :, :n] = source.keys[layer][row.slot, :, :n]
                    new_values[layer][first + i, :, :n] = source.values[layer][row.slot, :, :n]
            staged[capacity] = (new_keys, new_values, first)
        left = sorted(((row.slab, row.slot) for row in moving), key=lambda place: -place[1])
        for capacity, rows in entering.items():
            new_keys, new_values, first = staged[capacity]
            slab = self._install(capacity, new_keys, new_values)
            for i, row in enumerate(rows):
                row.slab, row.slot = capacity, first + i
                slab.rows.append(row)
        # then free the slots they left, the last ones of each slab first (those free without a move)
        for capacity, slot in left:
            self._free(self.slabs[capacity], slot)

    @torch.inference_mode()
    def remove(self, row: Row) -> None:
        """Free a row's slot; its slab's last row moves into it so the used ones stay contiguous."""
        self._free(self.slabs[row.slab], row.slot)
        row.slot, row.slab = -1, 0

    def _free(self, slab: Slab, slot: int) -> None:
        """Free `slot` of `slab` (its last row moves into it); a slab of a class above the first is dropped
        when its last row leaves."""
        last = len(slab.rows) - 1
        if slot != last:
            moved = slab.rows[last]
            n = moved.length
            for layer in range(self.num_layers):
                slab.keys[layer][slot, :, :n] = slab.keys[layer][last, :, :n]
                slab.values[layer][slot, :, :n] = slab.values[layer][last, :, :n]
            moved.slot = slot
            slab.rows[slot] = moved
        slab.rows.pop()
        if not slab.rows and slab.capacity != self._initial[1]:
            self.slabs = {c: other for c, other in self.slabs.items() if other is not slab}

    def _zeros(self, slots: int, capacity: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        shape = (slots, self.kv_heads, self.positions(capacity), self.head_dim)
        return ([torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)],
                [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)])

    def _room(self, capacity: int, extra: int) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
        """Keys, values and used slot count of class `capacity` with room for `extra` more rows after its
        used slots: the slab's own tensors when it has that room, else new ones holding its rows (twice
        its slots, or as many as needed; a new class gets exactly `extra`, the first class at least its
        initial slots), rounded up to a power of two. The cache itself is not changed."""
        slab = self.slabs.get(capacity)
        used = len(slab.rows) if slab is not None else 0
        if slab is not None and used + extra <= slab.num_slots:
            return slab.keys, slab.values, used
        if slab is not None:
            slots = max(used + extra, 2 * slab.num_slots)
        else:
            slots = max(extra, self._initial[0]) if capacity == self._initial[1] else extra
        # a power of two: a GPU's fixed-shape decode step pads its batch to one, into spare slots
        slots = 1 << (slots - 1).bit_length()
        new_keys, new_values = self._zeros(slots, capacity)
        if used:
            for layer in range(self.num_layers):
                new_keys[layer][:used] = slab.keys[layer][:used]
                new_values[layer][:used] = slab.values[layer][:used]
        return new_keys, new_values, used

    def _install(self, capacity: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> Slab:
        """The slab of class `capacity` holding `keys` and `values` (new, or its tensors replaced)."""
        slab = self.slabs.get(capacity)
        if slab is None:
            slab = Slab(capacity, keys, values)
            self.slabs = dict(sorted({**self.slabs, capacity: slab}.items()))
        else:
            slab.keys, slab.values = keys, values
        return slab
