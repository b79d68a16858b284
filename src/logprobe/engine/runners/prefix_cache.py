"""Keys and values of token sequences already run, kept across requests (the lean runner's), so that a
later prompt beginning with the same tokens runs only its own tokens through the blocks.

Every kind of request finds and fills it: a generation's prompt (prefilled in chunks, lean/prefill.py)
starts after its longest kept prefix and keeps its own whole blocks when its prompt is done; a finished
generation keeps its prompt and what it generated (the first choice's row of the KV cache, when it
leaves); prompt-only batches (scoring, echo, batch lines: lean/prompt_batch.py) use and fill it as
before. A client that picks every token itself (one request per token, its prompt the ids so far) thus
runs about one block of new tokens a call, not its whole context. Requests with interventions run a
modified pass: they neither use nor fill it.

Mechanism: the present cache generalised, not vLLM's paged blocks nor SGLang's radix tree. Prefixes are
indexed at block boundaries of BLOCK tokens by a hash chained over the blocks (a prefix of 48 tokens is
found under its hashes at 16, 32 and 48), as vLLM's automatic prefix caching indexes its blocks, and a hit
is taken only once its tokens are compared with the prompt's, so a collision costs a comparison, never
a wrong answer. The memory is not paged: SDPA on a CPU reads a row's keys as one tensor, so an entry's
keys and values live in one contiguous `Store` per sequence (per layer [KV, capacity, d], and the final
hidden states [capacity, D] where they were computed). A store may have room past its entries, and the
request that extends its longest entry (the next call of a client loop) writes its new positions there
instead of copying the prefix: `claim`, then `adopt` its longer prefix as a new entry on the same store
(which drops the shorter one). A request that branches inside an entry, or needs more room, copies the
prefix into a store of its own, half as large again as its prompt when it extends an entry (so a loop
copies now and then, not every call). Paged blocks would share a prefix's memory between branches; here a
branch holds its prefix again, within the same bound.

Memory is bounded by bytes: every store an entry uses, counted once (a store with room counts its
room), least recently used entries out first; an entry larger than the bound is not kept, and a bound of
0 turns the cache off. `hits`, `misses`, `tokens_saved` (prefix tokens a hit spared the blocks) and
`nbytes` are what /metrics reports.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

BLOCK = 16  # prefixes are kept and found in whole blocks of this many tokens


def block_hash(previous: int, block: tuple[int, ...]) -> int:
    """The chained hash of a prefix ending with `block`, given the hash of the prefix before it (0 for
    none). Python's hash of a tuple of ints does not depend on PYTHONHASHSEED, and a collision is caught
    by the token comparison on every hit."""
    return hash((previous, block))


def chain(ids: list[int], blocks: int) -> list[int]:
    """The chained hashes of the first 1..`blocks` whole blocks of `ids`."""
    out, h = [], 0
    for b in range(blocks):
        h = block_hash(h, tuple(ids[b * BLOCK:(b + 1) * BLOCK]))
        out.append(h)
    return out


def grown(length: int) -> int:
    """The capacity of a store for a sequence of `length` positions that is seen to grow: half as large
    again, in whole blocks, so a client adding a token a call copies its prefix once in `length / 2` calls."""
    return -(-(length + max(length // 2, BLOCK)) // BLOCK) * BLOCK


class Store:
    """The memory of one or more entries: per layer keys and values [KV, capacity, d], final hidden states
    [capacity, D] (None where none were kept). `frontier`: the positions the longest entry on it holds
    (what a writer may append after); `writer`: who is writing past the frontier now (a prefill's state),
    or None; `tail`: (the token ids, whether with their hidden states) that the last writer left written
    past the frontier, short of a whole block: the next writer that goes on with the same tokens starts
    after them, so a client adding one token a call runs one token a call."""

    __slots__ = ("keys", "values", "hidden", "capacity", "frontier", "writer", "users", "nbytes", "tail")

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], hidden: torch.Tensor | None):
        self.keys, self.values, self.hidden = keys, values, hidden
        self.capacity = keys[0].shape[1]
        self.frontier = 0
        self.writer = None
        self.tail: tuple[list[int], bool] | None = None
        self.users = 0  # entries on it
        self.nbytes = sum(t.untyped_storage().nbytes() for t in [*keys, *values, *([hidden] if hidden is not None else [])])

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


class Entry:
    """One kept prefix: its token ids (a multiple of BLOCK) over the first positions of `store`, of which
    the first `hidden_length` have their final hidden states kept too."""

    __slots__ = ("ids", "store", "hidden_length", "hashes")

    def __init__(self, ids: list[int], store: Store, hidden_length: int, hashes: list[int]):
        self.ids, self.store, self.hidden_length, self.hashes = ids, store, hidden_length, hashes

    @property
    def keys(self) -> list[torch.Tensor]:
        return [k[:, :len(self.ids)] for k in self.store.keys]

    @property
    def values(self) -> list[torch.Tensor]:
        return [v[:, :len(self.ids)] for v in self.store.values]

    @property
    def hidden(self) -> torch.Tensor | None:
        return None if self.store.hidden is None else self.store.hidden[:self.hidden_length]


class Hit:
    """A lookup's answer: the first `length` tokens of the prompt are held by `entry`."""

    __slots__ = ("entry", "length")

    def __init__(self, entry: Entry, length: int):
        self.entry, self.length = entry, length

    def views(self) -> tuple[int, list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]:
        """(length, keys [KV, length, d] per layer, values likewise, hidden [length, D] or None)."""
        n, store = self.length, self.entry.store
        hidden = store.hidden[:n] if store.hidden is not None and self.entry.hidden_length >= n else None
        return n, [k[:, :n] for k in store.keys], [v[:, :n] for v in store.values], hidden

    @property
    def extends(self) -> bool:
        """Whether the prompt goes on from the end of the longest entry on its store (a writer may append)."""
        return self.length == self.entry.store.frontier


class PrefixCache:
    """Token sequences' keys, values and hidden states, found by their first tokens (module docstring)."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError("max_bytes must be at least 0")
        self.max_bytes = int(max_bytes)
        self.entries: OrderedDict[Entry, None] = OrderedDict()  # least recently used first
        self.index: dict[int, list[Entry]] = {}  # chained hash at a block boundary -> entries reaching it
        self.nbytes = 0  # of the stores entries use, each once
        self.hits = 0
        self.misses = 0
        self.tokens_saved = 0  # prefix tokens that hits spared the blocks

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self.entries)

    def _holder(self, ids: list[int], hashes: list[int], blocks: int, hidden: bool = False) -> Entry | None:
        """An entry whose tokens begin with the first `blocks` blocks of `ids` (`hashes`: their chain),
        with their hidden states kept where `hidden`."""
        length = blocks * BLOCK
        for entry in self.index.get(hashes[blocks - 1], ()):
            if len(entry.ids) >= length and entry.ids[:length] == ids[:length] and \
                    (not hidden or (entry.store.hidden is not None and entry.hidden_length >= length)):
                return entry
        return None

    def find(self, prompt_ids: list[int], hidden: bool = False) -> Hit | None:
        """The longest kept prefix of `prompt_ids` that is a whole number of blocks and leaves the prompt
        one token of its own at least (the state before a token is what predicts it), with its hidden
        states where `hidden` (a request that reads the prefix's own columns). None on a miss."""
        if not self.enabled:
            return None
        blocks = (len(prompt_ids) - 1) // BLOCK
        hashes = chain(prompt_ids, blocks) if self.entries else []
        for b in range(len(hashes), 0, -1):  # the longest first
            entry = self._holder(prompt_ids, hashes, b, hidden)
            if entry is not None:
                break
        else:
            self.misses += 1
            return None
        self.entries.move_to_end(entry)
        self.hits += 1
        self.tokens_saved += b * BLOCK
        return Hit(entry, b * BLOCK)

    def lookup(self, prompt_ids: list[int]) -> tuple[int, list[torch.Tensor], list[torch.Tensor], torch.Tensor] | None:
        """`find`'s views, with hidden states: (length, keys [KV, length, d] per layer, values likewise,
        hidden [length, D]); None on a miss."""
        hit = self.find(prompt_ids, hidden=True)
        return None if hit is None else hit.views()

    def covers(self, ids: list[int]) -> bool:
        """Whether inserting `ids` would add nothing: an entry already holds them cut to whole blocks, they
        are shorter than a block, or the cache is off."""
        blocks = len(ids) // BLOCK
        return not self.enabled or not blocks or self._holder(ids, chain(ids, blocks), blocks) is not None

    def branches(self, ids: list[int], length: int) -> bool:
        """Whether an entry holds the first `length` tokens of `ids` (whole blocks) and more after them
        that `ids` does not share: an entry for a longer prefix of `ids` would hold those tokens twice
        (entries on different stores do not share memory), where one that only extends an entry replaces it."""
        blocks = length // BLOCK
        if not self.enabled or not blocks:
            return False
        return any(len(e.ids) > length and e.ids[:length] == ids[:length]
                   for e in self.index.get(chain(ids, blocks)[-1], ()))

    # ---- writing past an entry, in place -------------------------------------------------------
    def tail_of(self, hit: Hit, prompt_ids: list[int], hidden: bool = False) -> int:
        """How many tokens after the hit's prefix the store holds already for this prompt: those its last
        writer left past the frontier (`Store.tail`) that the prompt goes on with, short of its last
        token (with their hidden states where `hidden`). Counted as saved."""
        store = hit.entry.store
        if not hit.extends or store.writer is not None or store.tail is None or (hidden and not store.tail[1]):
            return 0
        tail, limit, n = store.tail[0], len(prompt_ids) - 1 - hit.length, 0
        while n < min(len(tail), limit) and tail[n] == prompt_ids[hit.length + n]:
            n += 1
        self.tokens_saved += n
        return n

    @staticmethod
    def claim(hit: Hit, length: int, writer) -> Store | None:
        """The hit's store, for `writer` to write positions hit.length..length-1 of its prompt in place:
        where the prompt extends the store's longest entry, nobody else writes there and the store has
        room. None otherwise (the writer copies the prefix into a store of its own)."""
        store = hit.entry.store
        if not hit.extends or store.writer is not None or store.capacity < length:
            return None
        store.writer, store.tail = writer, None
        return store

    @staticmethod
    def release(store: Store, writer, ids: list[int], written: int, hidden: bool) -> None:
        """`writer` is done writing (adopted or not): it leaves positions frontier..written-1 holding
        `ids` there (with their hidden states where `hidden`), for the next writer that goes on with them."""
        if store.writer is writer:
            store.writer = None
            store.tail = (list(ids[store.frontier:written]), hidden) if written > store.frontier else None

    # ---- keeping -------------------------------------------------------------------------------
    def adopt(self, ids: list[int], store: Store, hidden_length: int = 0, replace: bool = False) -> bool:
        """Keep the prefix `ids` (cut to whole blocks) over the first positions of `store`, written
        already, without a copy; `hidden_length` of them with their hidden states. Nothing is kept for
        fewer than BLOCK tokens, a prefix an entry already holds, or a store larger than the bound; kept
        entries that are prefixes of the new one (and keep no more hidden states) are dropped. Least
        recently used entries go until the store fits. `replace`: an entry holding just these tokens
        (on another store, with no more hidden states) gives way (a copy made to write past it). Whether
        it was kept."""
        blocks = len(ids) // BLOCK
        if not self.enabled or not blocks or store.capacity < blocks * BLOCK:
            return False
        m = blocks * BLOCK
        ids = list(ids[:m])
        hashes = chain(ids, blocks)
        hidden_length = min(hidden_length, m) if store.hidden is not None else 0
        if replace:
            for entry in list(self.index.get(hashes[-1], ())):
                if entry.ids == ids and entry.store is not store and entry.hidden_length <= hidden_length:
                    self._drop(entry)
        held = self._holder(ids, hashes, blocks, hidden=hidden_length >= m)
        if held is not None:
            return False
        size = 0 if store.users else store.nbytes
        if size > self.max_bytes:
            return False
        for b in range(1, blocks + 1):  # entries this one holds whole
            for entry in list(self.index.get(hashes[b - 1], ())):
                if len(entry.ids) == b * BLOCK and entry.ids == ids[:b * BLOCK] and \
                        min(entry.hidden_length, b * BLOCK) <= hidden_length:
                    self._drop(entry)
        store.users += 1  # held while older entries make room: not freed by its own drops
        size = store.nbytes if store.users == 1 else 0
        while self.nbytes + size > self.max_bytes and self.entries:
            self._drop(next(iter(self.entries)))
        entry = Entry(ids, store, hidden_length, hashes)
        self.entries[entry] = None
        for h in hashes:
            self.index.setdefault(h, []).append(entry)
        self.nbytes += size
        store.frontier = max(store.frontier, m)
        return True

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
                    hidden = entry.hidden[:b * BLOCK]
                    break
        if hidden is not None:
            size += hidden[:m].numel() * hidden.element_size()
        if size > self.max_bytes:
            return False
        store = Store([_own(k[:, :m]) for k in keys], [_own(v[:, :m]) for v in values],
                      None if hidden is None else _own(hidden[:m]))
        return self.adopt(ids[:m], store, 0 if hidden is None else hidden.shape[0])

    def _drop(self, entry: Entry) -> None:
        del self.entries[entry]
        for h in entry.hashes:
            bucket = self.index[h]
            bucket.remove(entry)
            if not bucket:
                del self.index[h]
        entry.store.users -= 1
        if not entry.store.users:
            self.nbytes -= entry.store.nbytes

    def clear(self) -> None:
        for entry in self.entries:
            entry.store.users = 0
        self.entries.clear()
        self.index.clear()
        self.nbytes = 0
