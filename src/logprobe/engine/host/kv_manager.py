"""The engine's KV cache manager: which rows of the batched KV cache each running group holds, where (a
size class and a slot in it), how long each is, and every decision that places, moves or frees one. No
torch: the runner keeps the memory (runners/kv_cache.py) and carries out the manager's decisions, which
every method here returns as a list of operations (`Alloc`, `Move`, `Keep`, `Drop`) to run in order.

The cache is in size classes: a class per capacity `initial * 2**i` (capped at the context length) holds
the rows whose length fits it, in slots 0..n-1 of its memory (per layer keys and values `[slots, kv
heads, positions, head dim]`). A row enters the smallest class with room for its prompt and one more
position; a row that fills its class moves into the next one (its keys and values copied once). A row's
class is at most twice its length (or the first class), and a class left without rows is dropped at once
(but the first class, where new prompts go: it goes back to its initial slots at the next decode step),
so the cache holds at most about twice the positions its rows hold, plus each class's spare slots (a
class's slots double when it is full, to a power of two: a GPU's fixed-shape decode step pads its batch to
one, into spare slots). Used slots are kept contiguous within a class: a freed slot is filled by moving
the class's last row into it, so a decode step attends over each class's plain view `[:n, :, :longest]`
with a length mask, without gathering.

The engine's core (engine/core.py) calls the manager as a step goes: `expand` as a prompt's choices start
decoding, `make_room` before a decode step and `advance` after it, `select` and `release` as choices and
groups end, `shrink` when idle and `reset` after a failed step. A group's first choice that ends well
leaves its tokens' keys and values in the engine's prefix cache (`Keep`, before the moves that free its
slot), where the prefix index (host/prefix_index.py) does not hold them yet. The transformers runner keeps
a cache per request and carries out none of the operations; the bookkeeping is the same for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Union


class Alloc(NamedTuple):
    """Class `capacity`'s memory becomes `slots` zeroed slots holding its first `keep` slots' keys and
    values as they were (a class not held yet has none: keep 0)."""

    capacity: int
    slots: int
    keep: int


class Move(NamedTuple):
    """Copy the first `length` positions of slot `source_slot` of class `source` into slot `slot` of class
    `capacity` (a row moving into a larger class, or into a slot freed in its own)."""

    source: int
    source_slot: int
    capacity: int
    slot: int
    length: int


class Keep(NamedTuple):
    """Put the first `len(ids)` positions of slot `slot` of class `capacity` (the keys and values of the
    tokens `ids`) in the engine's prefix cache."""

    capacity: int
    slot: int
    ids: tuple[int, ...]


class Drop(NamedTuple):
    """Let class `capacity`'s memory go (it holds no row)."""

    capacity: int


Op = Union[Alloc, Move, Keep, Drop]


@dataclass(eq=False)
class Row:
    """One decoding sequence's place in the cache: its class (`slab`, a capacity) and `slot` in it change
    when it moves to a larger class or when its class's slots are compacted."""

    group: object
    seq_index: int
    slot: int = -1
    length: int = 0  # positions written
    slab: int = 0  # the capacity of the class holding it (0: none)


class SlotClass:
    """The rows of one capacity class, in slots 0..len(rows)-1 of its `num_slots`."""

    __slots__ = ("capacity", "num_slots", "rows")

    def __init__(self, capacity: int, num_slots: int):
        self.capacity, self.num_slots = capacity, num_slots
        self.rows: list[Row] = []


class KVManager:
    def __init__(self, max_len: int, slots: int = 4, capacity: int = 256, prefix_index=None,
                 keep_generated: bool = True):
        """`max_len`: the context length (the largest class); `slots` and `capacity`: the first class's.
        `prefix_index`: the engine's prefix cache (host/prefix_index.py), where a finished first choice's
        keys and values are kept (None: nowhere). `keep_generated`: whether the keys of generated tokens are
        kept too (not with 4-bit decode weights: a later prompt with their text computes them with the dense
        ones, which give other bits), or the prompt's only."""
        self.max_len = max_len
        self.prefix_index = prefix_index
        self.keep_generated = keep_generated
        self._initial = (slots, min(capacity, max_len))
        # capacity -> class, in ascending capacity; replaced (never changed in place) when a class joins or
        # leaves, so a reader on another thread iterates a whole one
        self.classes: dict[int, SlotClass] = {}
        self.held: dict[object, list[Row]] = {}  # per group holding rows: its rows, in its choices' order
        self.reset()

    # ---- reading -----------------------------------------------------------------------------
    @property
    def rows(self) -> tuple[Row, ...]:
        """Every row, class by class in ascending capacity, in slot order within a class."""
        return tuple(row for slot_class in self.classes.values() for row in slot_class.rows)

    @property
    def num_rows(self) -> int:
        return sum(len(slot_class.rows) for slot_class in self.classes.values())

    def rows_of(self, group) -> list[Row]:
        return self.held.get(group, [])

    def class_for(self, length: int) -> int:
        """The smallest capacity class with room for `length` positions (the context length at most)."""
        capacity = self._initial[1]
        while capacity < length and capacity < self.max_len:
            capacity *= 2
        return min(capacity, self.max_len)

    def holds(self, row: Row) -> bool:
        """Whether `row` is where it says: in slot `row.slot` of class `row.slab`."""
        slot_class = self.classes.get(row.slab)
        return slot_class is not None and 0 <= row.slot < len(slot_class.rows) and slot_class.rows[row.slot] is row

    def is_consistent(self, running=None) -> bool:
        """Whether the bookkeeping is whole: in every class, slots 0..n-1 used by its n rows, in order, each
        row within the class's capacity and naming it; classes in ascending capacity; no row held twice;
        every row a group's. With `running`: no group outside it holds a row."""
        capacities = list(self.classes)
        if capacities != sorted(capacities):
            return False
        for capacity, slot_class in self.classes.items():
            if slot_class.capacity != capacity or len(slot_class.rows) > slot_class.num_slots:
                return False
            if not all(row.slab == capacity and row.slot == i and 0 <= row.length <= capacity
                       for i, row in enumerate(slot_class.rows)):
                return False
        held = [(group, row) for group, rows in self.held.items() for row in rows]
        if len({id(row) for row in self.rows}) != self.num_rows or len(held) != self.num_rows:
            return False
        if not all(row.group is group and self.holds(row) for group, row in held):
            return False
        return running is None or set(map(id, self.held)) <= set(map(id, running))

    # ---- a step's decisions ------------------------------------------------------------------
    def expand(self, group, length: int) -> tuple[list[Row], list[Op]]:
        """A prompt of `length` tokens is done and the group's active choices go on decoding: each gets a
        slot in the smallest class with room for the prompt and one more position (the class grows once
        for all of them, if it must). The rows (the runner writes the prompt's keys and values in their
        slots), and the operations that make the room."""
        if group in self.held:
            raise RuntimeError(f"{getattr(group, 'request_id', group)} holds KV rows already")
        capacity = self.class_for(length + 1)
        ops, first = self._room(capacity, len(group.active_rows))
        rows = [Row(group, seq_index, first + i, length, capacity) for i, seq_index in enumerate(group.active_rows)]
        self.classes[capacity].rows.extend(rows)
        self.held[group] = rows
        return rows, ops

    def make_room(self) -> list[Op]:
        """Room for one more position in every row (before a decode step): each row whose class is full
        moves into the next class (a class it enters grows first, if it must). Then the first class, once
        its rows have all left, goes back to its initial slots."""
        ops: list[Op] = []
        moving = [row for c in self.classes.values() for row in c.rows if row.length >= c.capacity]
        if moving:
            ops += self._move_up(moving)
        slots, capacity = self._initial
        first = self.classes.get(capacity)
        if first is not None and not first.rows and first.num_slots > slots:
            first.num_slots = slots
            ops.append(Alloc(capacity, slots, 0))
        return ops

    def advance(self) -> None:
        """A decode step wrote one more position of every row."""
        for row in self.rows:
            row.length += 1

    def select(self, group, keep: list[int]) -> list[Op]:
        """Keep the group's rows at the places `keep` (the other choices finished): the others' slots are
        freed (a finished first choice's keys and values kept in the prefix cache first)."""
        ops: list[Op] = []
        kept = []
        for place, row in enumerate(self.held.get(group, [])):
            if place in keep:
                kept.append(row)
            else:
                ops += self._leave(group, row)
        if group in self.held:
            self.held[group] = kept
        return ops

    def release(self, group) -> list[Op]:
        """The group is done (finished, aborted or failed): its rows' slots are freed; a finished or
        aborted group's first choice is kept in the prefix cache first."""
        ops: list[Op] = []
        for row in self.held.pop(group, []):
            if row.slot >= 0:
                ops += self._leave(group, row)
        return ops

    def shrink(self) -> list[Op]:
        """Drop every class that holds no row; with no row held, back to the initial state (the cache only
        grows while busy)."""
        slots, capacity = self._initial
        if not self.num_rows:
            first = self.classes.get(capacity)
            if len(self.classes) == 1 and first is not None and first.num_slots == slots:
                return []
            ops: list[Op] = [Drop(c) for c in self.classes]
            self.classes = {capacity: SlotClass(capacity, slots)}
            return ops + [Alloc(capacity, slots, 0)]
        empty = [c for c, slot_class in self.classes.items() if not slot_class.rows]
        self.classes = {c: slot_class for c, slot_class in self.classes.items() if slot_class.rows}
        return [Drop(c) for c in empty]

    def reset(self) -> None:
        """No row held, the first class at its initial slots (after a failed step, or at the start): the
        runner's memory is made to match (`runners/kv_cache.py`, `KVMemory.reset`)."""
        slots, capacity = self._initial
        self.classes = {capacity: SlotClass(capacity, slots)}
        self.held = {}

    # ---- inside ------------------------------------------------------------------------------
    def _leave(self, group, row: Row) -> list[Op]:
        """Free a row's slot. The first choice of a group that did not fail leaves its prompt and what it
        generated in the prefix cache (the last token picked never ran: its keys are not there), its
        prompt's only where generated keys are not kept (`keep_generated`)."""
        ops: list[Op] = []
        index = self.prefix_index
        if row.seq_index == 0 and getattr(group, "error", None) is None and not group.params.interventions and \
                index is not None and index.enabled and self.holds(row):
            ids = group.prompt_ids + group.sequences[0].token_ids[:row.length - group.num_prompt_tokens]
            if not self.keep_generated:
                ids = ids[:group.num_prompt_tokens]
            if not index.covers(ids):
                ops.append(Keep(row.slab, row.slot, tuple(ids)))
        ops += self._free(self.classes[row.slab], row.slot)
        row.slot, row.slab = -1, 0
        return ops

    def _free(self, slot_class: SlotClass, slot: int) -> list[Op]:
        """Free `slot` of `slot_class` (its last row moves into it); a class above the first is dropped when
        its last row leaves."""
        ops: list[Op] = []
        last = len(slot_class.rows) - 1
        if slot != last:
            moved = slot_class.rows[last]
            ops.append(Move(slot_class.capacity, last, slot_class.capacity, slot, moved.length))
            moved.slot = slot
            slot_class.rows[slot] = moved
        slot_class.rows.pop()
        if not slot_class.rows and slot_class.capacity != self._initial[1]:
            self.classes = {c: other for c, other in self.classes.items() if other is not slot_class}
            ops.append(Drop(slot_class.capacity))
        return ops

    def _room(self, capacity: int, extra: int) -> tuple[list[Op], int]:
        """Room in class `capacity` for `extra` more rows after its used slots: (the operation that grows
        it, if it must: twice its slots, or as many as needed; a new class gets exactly `extra`, the first
        class at least its initial slots; a power of two), and the first slot of the room."""
        slot_class = self.classes.get(capacity)
        used = len(slot_class.rows) if slot_class is not None else 0
        if slot_class is not None and used + extra <= slot_class.num_slots:
            return [], used
        if slot_class is not None:
            slots = max(used + extra, 2 * slot_class.num_slots)
        else:
            slots = max(extra, self._initial[0]) if capacity == self._initial[1] else extra
        slots = 1 << (slots - 1).bit_length()
        if slot_class is None:
            slot_class = SlotClass(capacity, slots)
            self.classes = dict(sorted({**self.classes, capacity: slot_class}.items()))
        slot_class.num_slots = slots
        return [Alloc(capacity, slots, used)], used

    def _move_up(self, moving: list[Row]) -> list[Op]:
        """Move each of `moving` (full rows) into the next class: the room and every copy first, then the
        slots they left freed (the last ones of each class first: those free without a move)."""
        entering: dict[int, list[Row]] = {}
        for row in moving:
            capacity = self.class_for(row.length + 1)
            if capacity <= row.slab:
                raise RuntimeError(f"a row of {row.length} positions is at the context length ({self.max_len})")
            entering.setdefault(capacity, []).append(row)
        ops: list[Op] = []
        left = sorted(((row.slab, row.slot) for row in moving), key=lambda place: -place[1])
        for capacity, rows in entering.items():
            room, first = self._room(capacity, len(rows))
            ops += room
            target = self.classes[capacity]
            for i, row in enumerate(rows):
                ops.append(Move(row.slab, row.slot, capacity, first + i, row.length))
            for i, row in enumerate(rows):
                row.slab, row.slot = capacity, first + i
                target.rows.append(row)
        for capacity, slot in left:
            ops += self._free(self.classes[capacity], slot)
        return ops
