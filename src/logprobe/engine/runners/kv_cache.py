"""The batched KV cache's memory, on the runner's device: per size class, per layer, keys and values
`[slots, kv heads, positions, head dim]`. Where rows go, when they move and when a class grows or goes are
the engine's KV cache manager's decisions (engine/host/kv_manager.py, no torch); this memory carries them
out (`apply`, the manager's operations in order) and is read by the decode passes through the manager's
layout (`slab`: a class's memory with its rows).

Every method runs under `torch.inference_mode()`, whoever calls it: the memory is grown inside decode
steps (inference mode) and written when a prompt's rows join (which may run outside it), and an inference
tensor cannot be updated in place outside inference mode. A class's memory is replaced (never resized in
place) when it grows, so a fixed-shape step recorded on the old tensors is let go
(lean/fixed_shape.py). An operation that fails (out of memory) leaves the memory out of step with the
manager: `matches` says so, and the engine then fails the step and starts both afresh.
"""

from __future__ import annotations

import torch

from ..host.kv_manager import Alloc, Drop, Keep, KVManager, Move, Op


class Slab:
    """One class's memory (`keys`, `values`: per layer [slots, KV, positions, d]) and, while a decode step
    reads it, its rows (the manager's, in slot order)."""

    __slots__ = ("capacity", "keys", "values", "rows")

    def __init__(self, capacity: int, keys: list[torch.Tensor], values: list[torch.Tensor], rows=()):
        self.capacity = capacity
        self.keys, self.values = keys, values
        self.rows = rows

    @property
    def num_slots(self) -> int:
        return self.keys[0].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


class KVMemory:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype, device, positions=None):
        """`positions(capacity)`: the positions a class's keys and values hold, `capacity` or more (the lean
        runner's on a CPU: `Attention.held`, positions whose read gives a row the bits of any longer read,
        where rows' reads stop at the class's end; None: `capacity`)."""
        self.positions = positions or (lambda capacity: capacity)
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        # capacity -> its memory; replaced (never changed in place) when a class joins or leaves, so a
        # reader on another thread (the engine's stats) iterates a whole one
        self.slabs: dict[int, Slab] = {}
        self.failed = False  # an operation failed part-way: out of step with the manager until `reset`

    @property
    def nbytes(self) -> int:
        """Bytes allocated (every class's keys and values, spare slots included)."""
        return sum(slab.nbytes for slab in self.slabs.values())

    def slab(self, manager: KVManager, capacity: int) -> Slab:
        """Class `capacity`'s memory with its rows (the manager's) as a decode step reads them."""
        memory = self.slabs[capacity]
        return Slab(capacity, memory.keys, memory.values, manager.classes[capacity].rows)

    def matches(self, manager: KVManager) -> bool:
        """Whether the memory holds exactly the manager's classes, each with its slots and positions, and
        no operation failed part-way."""
        if self.failed or list(self.slabs) != list(manager.classes):
            return False
        for capacity, slot_class in manager.classes.items():
            shape = (slot_class.num_slots, self.kv_heads, self.positions(capacity), self.head_dim)
            slab = self.slabs[capacity]
            if any(tuple(t.shape) != shape for t in slab.keys + slab.values):
                return False
        return True

    @torch.inference_mode()
    def reset(self, manager: KVManager) -> None:
        """New memory for the manager's classes (after a failed step, or at the start)."""
        self.slabs = {capacity: Slab(capacity, *self._zeros(c.num_slots, capacity))
                      for capacity, c in manager.classes.items()}
        self.failed = False

    @torch.inference_mode()
    def apply(self, ops: list[Op], keep=None) -> None:
        """Carry out the manager's operations, in order. `keep(ids, keys, values)`: where a `Keep` puts a
        row's keys and values (per layer [KV, len(ids), d], views of this memory: copied there)."""
        try:
            for op in ops:
                if isinstance(op, Move):
                    source, target, n = self.slabs[op.source], self.slabs[op.capacity], op.length
                    for layer in range(self.num_layers):
                        target.keys[layer][op.slot, :, :n] = source.keys[layer][op.source_slot, :, :n]
                        target.values[layer][op.slot, :, :n] = source.values[layer][op.source_slot, :, :n]
                elif isinstance(op, Alloc):
                    self._alloc(op)
                elif isinstance(op, Keep):
                    slab, n = self.slabs[op.capacity], len(op.ids)
                    if keep is not None:
                        keep(list(op.ids), [k[op.slot, :, :n] for k in slab.keys],
                             [v[op.slot, :, :n] for v in slab.values])
                elif isinstance(op, Drop):
                    self.slabs = {c: slab for c, slab in self.slabs.items() if c != op.capacity}
                else:
                    raise TypeError(f"not a KV cache operation: {op!r}")
        except BaseException:
            self.failed = True
            raise

    @torch.inference_mode()
    def write(self, capacity: int, slot: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """A prompt's keys and values (per layer [KV, P, d]) into slot `slot` of class `capacity`."""
        slab, n = self.slabs[capacity], keys[0].shape[1]
        for layer in range(self.num_layers):
            slab.keys[layer][slot, :, :n] = keys[layer]
            slab.values[layer][slot, :, :n] = values[layer]

    def _alloc(self, op: Alloc) -> None:
        keys, values = self._zeros(op.slots, op.capacity)
        old = self.slabs.get(op.capacity)
        if op.keep:
            for layer in range(self.num_layers):
                keys[layer][:op.keep] = old.keys[layer][:op.keep]
                values[layer][:op.keep] = old.values[layer][:op.keep]
        if old is None:
            self.slabs = dict(sorted({**self.slabs, op.capacity: Slab(op.capacity, keys, values)}.items()))
        else:  # new tensors in a new Slab: a fixed-shape step recorded on the old ones sees the change
            self.slabs = {c: Slab(c, keys, values) if c == op.capacity else slab for c, slab in self.slabs.items()}

    def _zeros(self, slots: int, capacity: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        shape = (slots, self.kv_heads, self.positions(capacity), self.head_dim)
        return ([torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)],
                [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)])
