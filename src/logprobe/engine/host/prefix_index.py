"""The prefix cache's index, on the host (no torch): which token sequences are kept, where, and what a
prompt finds of itself there. The engine makes one (runners/prefix_cache.py `PrefixCache` adds the
keeping of tensors), the scheduler reads it as it admits a prompt (the tokens a hit spares are counted
computed, so budgets charge only the rest), and the runner keeps what it ran there and reads the keys and
values of what the scheduler found.

Every kind of request finds and fills it: a generation's prompt (prefilled in chunks) starts after its
longest kept prefix and keeps its own whole blocks when its prompt is done; a finished generation keeps
its prompt and what it generated (the first choice's row of the KV cache, when it leaves); prompt-only
batches (scoring, echo, batch lines) and token trees use and fill it. A client that picks every token
itself (one request per token, its prompt the ids so far) thus runs about one block of new tokens a
call, not its whole context. Requests with interventions run a modified pass: they neither use nor fill it.

Mechanism: prefixes are indexed at block boundaries of BLOCK tokens by a hash chained over the blocks (a
prefix of 48 tokens is found under its hashes at 16, 32 and 48), as vLLM's automatic prefix caching
indexes its blocks, and a hit is taken only once its tokens are compared with the prompt's, so a
collision costs a comparison, never a wrong answer. The memory is not paged: SDPA on a CPU reads a row's
keys as one tensor, so an entry's keys and values live in one contiguous store per sequence (the runner's
`Store`: per layer [KV, capacity, d], and the final hidden states [capacity, D] where they were computed;
to the index an object with `capacity`, `nbytes`, `has_hidden` and the fields below). A store may have
room past its entries, and the request that extends its longest entry (the next call of a client loop)
writes its new positions there instead of copying the prefix: `claim`, then `adopt` its longer prefix as a
new entry on the same store (which drops the shorter one). A request that branches inside an entry, or
needs more room, copies the prefix into a store of its own, half as large again as its prompt when it
extends an entry (so a loop copies now and then, not every call). Paged blocks would share a prefix's
memory between branches; here a branch holds its prefix again, within the same bound.

Memory is bounded by bytes: every store an entry uses, counted once (a store with room counts its room),
least recently used entries out first; an entry larger than the bound is not kept, and a bound of 0 turns
the cache off. `hits`, `misses`, `tokens_saved` (prefix tokens a hit spared the blocks) and `nbytes` are
what /metrics reports.
"""

from __future__ import annotations

from collections import OrderedDict

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


def uses_prefix_cache(params) -> bool:
    """Whether a request's passes use and fill the prefix cache: not one with interventions, whose passes
    are modified (its keys are not the model's)."""
    return not params.interventions


def prompt_hits(index: "PrefixIndex | None", groups) -> list:
    """Per prompt-only group, its longest kept prefix with the hidden states (what its columns read), or
    None: a miss, a request that does not use the cache, or no cache."""
    if index is None or not index.enabled:
        return [None] * len(groups)
    return [index.find(g.prompt_ids, hidden=True) if uses_prefix_cache(g.params) else None for g in groups]


class StoreState:
    """What the index keeps on each store besides its memory (the runner's `Store` is one): `frontier`,
    the positions the longest entry on it holds (what a writer may append after); `writer`, who is
    writing past the frontier now (a prefill's state), or None; `tail`, (the token ids, whether with
    their hidden states) that the last writer left written past the frontier, short of a whole block (the
    next writer that goes on with the same tokens starts after them, so a client adding one token a call
    runs one token a call); `users`, the entries on it."""

    __slots__ = ("frontier", "writer", "tail", "users")

    def __init__(self):
        self.frontier = 0
        self.writer = None
        self.tail: tuple[list[int], bool] | None = None
        self.users = 0


class Entry:
    """One kept prefix: its token ids (a multiple of BLOCK) over the first positions of `store`, of which
    the first `hidden_length` have their final hidden states kept too."""

    __slots__ = ("ids", "store", "hidden_length", "hashes")

    def __init__(self, ids: list[int], store, hidden_length: int, hashes: list[int]):
        self.ids, self.store, self.hidden_length, self.hashes = ids, store, hidden_length, hashes


class Hit:
    """A lookup's answer: the first `length` tokens of the prompt are held by `entry`."""

    __slots__ = ("entry", "length")

    def __init__(self, entry: Entry, length: int):
        self.entry, self.length = entry, length

    @property
    def has_hidden(self) -> bool:
        """Whether the held positions have their final hidden states kept."""
        return self.entry.store.has_hidden and self.entry.hidden_length >= self.length

    @property
    def extends(self) -> bool:
        """Whether the prompt goes on from the end of the longest entry on its store (a writer may append)."""
        return self.length == self.entry.store.frontier


class PrefixIndex:
    """Token sequences kept, found by their first tokens (module docstring)."""

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
                    (not hidden or (entry.store.has_hidden and entry.hidden_length >= length)):
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

    def covers(self, ids: list[int]) -> bool:
        """Whether keeping `ids` would add nothing: an entry already holds them cut to whole blocks, they
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

    # ---- a prompt admitted ---------------------------------------------------------------------
    def start(self, prompt_ids: list[int], hidden: bool) -> tuple[Hit | None, int]:
        """What a prompt admitted to prefill finds of itself (`hidden`: with the hidden states, for a
        request that reads its prompt's columns): (the hit, or None; how many of its tokens are held,
        the hit's and those its store's last writer left past it: `tail_of`). Those are not computed."""
        hit = self.find(prompt_ids, hidden=hidden)
        return hit, 0 if hit is None else hit.length + self.tail_of(hit, prompt_ids, hidden)

    # ---- writing past an entry, in place -------------------------------------------------------
    def tail_of(self, hit: Hit, prompt_ids: list[int], hidden: bool = False) -> int:
        """How many tokens after the hit's prefix the store holds already for this prompt: those its last
        writer left past the frontier (`tail`) that the prompt goes on with, short of its last token
        (with their hidden states where `hidden`). Counted as saved."""
        store = hit.entry.store
        if not hit.extends or store.writer is not None or store.tail is None or (hidden and not store.tail[1]):
            return 0
        tail, limit, n = store.tail[0], len(prompt_ids) - 1 - hit.length, 0
        while n < min(len(tail), limit) and tail[n] == prompt_ids[hit.length + n]:
            n += 1
        self.tokens_saved += n
        return n

    @staticmethod
    def claim(hit: Hit, length: int, writer):
        """The hit's store, for `writer` to write positions hit.length..length-1 of its prompt in place:
        where the prompt extends the store's longest entry, nobody else writes there and the store has
        room. None otherwise (the writer copies the prefix into a store of its own)."""
        store = hit.entry.store
        if not hit.extends or store.writer is not None or store.capacity < length:
            return None
        store.writer, store.tail = writer, None
        return store

    @staticmethod
    def release(store, writer, ids: list[int], written: int, hidden: bool) -> None:
        """`writer` is done writing (adopted or not): it leaves positions frontier..written-1 holding
        `ids` there (with their hidden states where `hidden`), for the next writer that goes on with them."""
        if store.writer is writer:
            store.writer = None
            store.tail = (list(ids[store.frontier:written]), hidden) if written > store.frontier else None

    # ---- keeping -------------------------------------------------------------------------------
    def adopt(self, ids: list[int], store, hidden_length: int = 0, replace: bool = False) -> bool:
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
        hidden_length = min(hidden_length, m) if store.has_hidden else 0
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
