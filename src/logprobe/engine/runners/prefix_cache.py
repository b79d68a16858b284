"""The prefix cache's memory, on the runner's device: the keys, values and final hidden states of token
sequences already run, kept across requests so that a later prompt beginning with the same tokens runs
only its own tokens through the blocks. What is kept and found, and the rules of both, are the index's
(engine/host/prefix_index.py, no torch), which the engine makes (`PrefixCache`: the index with the
tensors' keeping) and hands to the scheduler, which finds a prompt's hit as it admits it, and to the lean
runner, which reads the hit's keys and values (`views`) and keeps what it ran (`adopt` on a store it
wrote, or `insert`, a copy).
"""

from __future__ import annotations

import torch

from ..host.prefix_index import BLOCK, Entry, Hit, PrefixIndex, StoreState, chain, grown  # noqa: F401 (the runners' names)


class Store(StoreState):
    """The memory of one or more entries: per layer keys and values [KV, capacity, d], final hidden states
    [capacity, D] (None where none were kept); the index's state of it (`StoreState`: frontier, writer,
    tail, users)."""

    __slots__ = ("keys", "values", "hidden", "capacity", "nbytes")

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], hidden: torch.Tensor | None):
        super().__init__()
        self.keys, self.values, self.hidden = keys, values, hidden
        self.capacity = keys[0].shape[1]
        self.nbytes = sum(t.untyped_storage().nbytes() for t in [*keys, *values, *([hidden] if hidden is not None else [])])

    @property
    def has_hidden(self) -> bool:
        return self.hidden is not None

    @classmethod
    def empty(cls, layers: int, kv_heads: int, head_dim: int, width: int | None, capacity: int, dtype, device) -> "Store":
        """A store of `capacity` positions holding zeros; with hidden states of `width` (None: none)."""
        shape = (kv_heads, capacity, head_dim)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
                   None if width is None else torch.empty((capacity, width), dtype=dtype, device=device))


def _own(t: torch.Tensor) -> torch.Tensor:
    """`t` as a tensor holding exactly its own memory: a view of a larger tensor (a batch's keys, a
    slice) is copied, so an entry's bytes are what the cache counts."""
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def views(hit: Hit) -> tuple[int, list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]:
    """A hit's memory: (length, keys [KV, length, d] per layer, values likewise, hidden [length, D] or None)."""
    n, store = hit.length, hit.entry.store
    hidden = store.hidden[:n] if hit.has_hidden else None
    return n, [k[:, :n] for k in store.keys], [v[:, :n] for v in store.values], hidden


class PrefixCache(PrefixIndex):
    """The index (host/prefix_index.py) with the keeping of tensors: what the engine makes and hands to
    the scheduler and the lean runner."""

    def lookup(self, prompt_ids: list[int]) -> tuple[int, list[torch.Tensor], list[torch.Tensor], torch.Tensor] | None:
        """`find`'s views, with hidden states: (length, keys [KV, length, d] per layer, values likewise,
        hidden [length, D]); None on a miss."""
        hit = self.find(prompt_ids, hidden=True)
        return None if hit is None else views(hit)

    def insert(self, ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor],
               hidden: torch.Tensor | None) -> bool:
        """Keep the prefix `ids` (cut to whole blocks) with its keys and values [KV, >= m, d] per layer and
        hidden states [>= m, D] (None: none), copied into a store of their own unless they already hold
        just their own memory (`adopt`'s rules). Where `hidden` is None and a kept entry holds the first
        blocks of `ids` with their hidden states (a generation's prompt), those are copied in."""
        blocks = len(ids) // BLOCK
        if not self.enabled or not blocks:
            return False
        m = blocks * BLOCK
        hashes = chain(ids, blocks)
        if self._holder(ids, hashes, blocks, hidden=hidden is not None) is not None or \
                (hidden is None and self._holder(ids, hashes, blocks) is not None):
            return False
        size = sum(t[..., :m, :].numel() * t.element_size() for t in [*keys, *values])
        if hidden is None:
            for b in range(blocks, 0, -1):
                entry = self._holder(ids, hashes, b, hidden=True)
                if entry is not None:
                    hidden = entry.store.hidden[:b * BLOCK]
                    break
        if hidden is not None:
            size += hidden[:m].numel() * hidden.element_size()
        if size > self.max_bytes:
            return False
        store = Store([_own(k[:, :m]) for k in keys], [_own(v[:, :m]) for v in values],
                      None if hidden is None else _own(hidden[:m]))
        return self.adopt(ids[:m], store, 0 if hidden is None else hidden.shape[0])
