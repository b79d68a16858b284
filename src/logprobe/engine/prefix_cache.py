"""Prompt prefixes' keys and values kept across batches, for prompt-only requests (the lean runner's
`prefill_batch`).

lm-evaluation-harness sorts its requests by length, so the answers of one multiple-choice question
seldom arrive in one batch, and sharing a context's pass within a batch (`_prefill_shared`) misses
them. This cache keeps, per prefix, the keys and values of every layer and the final-normed hidden
states, so a later prompt that begins with the same tokens runs only its own tokens through the blocks
and attends to the kept keys and values (its prompt columns over the prefix still come from the kept
hidden states, through the head, as in one pass). vLLM turns its prefix cache off for requests that ask
for prompt log probabilities; here those are the only requests that use it. Measured with
benchmarks/multiple_choice.py (24 questions of a 91-95 token context and 4 answers, each answer its own
batch, longest first; bundled model, float32, 2 vCPUs): 3,568 tokens through the blocks instead of
9,328 and 1.5x less time, the log probabilities within 6.4e-6 of the cache off.

Prefixes are indexed at block boundaries of BLOCK tokens by a hash chained over the blocks (a prefix
of 48 tokens is found under its hashes at 16, 32 and 48), and a hit is only taken once its tokens are
compared with the prompt's, so a hash collision costs a comparison, never a wrong answer. Memory is
bounded by bytes (keys, values and hidden states of every entry), least recently used first out; an
entry larger than the bound is not kept, and a bound of 0 turns the cache off.
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


def _own(t: torch.Tensor) -> torch.Tensor:
    """`t` as a tensor holding exactly its own memory: a view of a larger tensor (a batch's keys, a
    slice) is copied, so an entry's bytes are what the cache counts."""
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


class Entry:
    """One kept prefix: its token ids (a multiple of BLOCK), per layer keys and values [KV, m, d], and
    the final-normed hidden states [m, D]."""

    __slots__ = ("ids", "keys", "values", "hidden", "hashes", "nbytes")

    def __init__(self, ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor], hidden: torch.Tensor,
                 hashes: list[int]):
        self.ids, self.keys, self.values, self.hidden, self.hashes = ids, keys, values, hidden, hashes
        self.nbytes = sum(t.numel() * t.element_size() for t in [*keys, *values, hidden])


class PrefixCache:
    """Prompt prefixes' keys, values and hidden states, found by their first tokens (module docstring)."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError("max_bytes must be at least 0")
        self.max_bytes = int(max_bytes)
        self.entries: OrderedDict[Entry, None] = OrderedDict()  # least recently used first
        self.index: dict[int, list[Entry]] = {}  # chained hash at a block boundary -> entries reaching it
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self.entries)

    def _holder(self, ids: list[int], hashes: list[int], blocks: int) -> Entry | None:
        """An entry whose tokens begin with the first `blocks` blocks of `ids` (`hashes`: their chain)."""
        length = blocks * BLOCK
        for entry in self.index.get(hashes[blocks - 1], ()):
            if len(entry.ids) >= length and entry.ids[:length] == ids[:length]:
                return entry
        return None

    def lookup(self, prompt_ids: list[int]) -> tuple[int, list[torch.Tensor], list[torch.Tensor], torch.Tensor] | None:
        """(length, keys [KV, length, d] per layer, values likewise, hidden [length, D]) of the longest kept
        prefix of `prompt_ids` that is a whole number of blocks and leaves the prompt one token of its own
        at least (the state before a token is what predicts it); views of the entry. None on a miss."""
        if not self.enabled:
            return None
        blocks = (len(prompt_ids) - 1) // BLOCK
        hashes = chain(prompt_ids, blocks) if self.entries else []
        for b in range(len(hashes), 0, -1):  # the longest first
            entry = self._holder(prompt_ids, hashes, b)
            if entry is not None:
                break
        else:
            self.misses += 1
            return None
        length = b * BLOCK
        self.entries.move_to_end(entry)
        self.hits += 1
        return (length, [k[:, :length] for k in entry.keys], [v[:, :length] for v in entry.values],
                entry.hidden[:length])

    def covers(self, ids: list[int]) -> bool:
        """Whether inserting `ids` would add nothing: an entry already holds them cut to whole blocks, they
        are shorter than a block, or the cache is off."""
        blocks = len(ids) // BLOCK
        return not self.enabled or not blocks or self._holder(ids, chain(ids, blocks), blocks) is not None

    def branches(self, ids: list[int], length: int) -> bool:
        """Whether an entry holds the first `length` tokens of `ids` (whole blocks) and more after them
        that `ids` does not share: an entry for a longer prefix of `ids` would hold those tokens twice
        (entries do not share memory), where one that only extends an entry replaces it."""
        blocks = length // BLOCK
        if not self.enabled or not blocks:
            return False
        return any(len(e.ids) > length and e.ids[:length] == ids[:length]
                   for e in self.index.get(chain(ids, blocks)[-1], ()))

    def insert(self, ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor],
               hidden: torch.Tensor) -> bool:
        """Keep the prefix `ids` (cut to whole blocks) with its keys and values [KV, >= m, d] per layer and
        hidden states [>= m, D], copied unless they already hold just their own memory. Nothing is kept
        for fewer than BLOCK tokens, a prefix an entry already holds, or one larger than the bound; kept
        entries that are prefixes of the new one are dropped (it answers for them). Least recently used
        entries go until the new one fits. Whether it was kept."""
        blocks = len(ids) // BLOCK
        if not self.enabled or not blocks:
            return False
        m = blocks * BLOCK
        ids = list(ids[:m])
        hashes = chain(ids, blocks)
        if self._holder(ids, hashes, blocks) is not None:
            return False
        size = sum(t[..., :m, :].numel() * t.element_size() for t in [*keys, *values]) + \
            hidden[:m].numel() * hidden.element_size()
        if size > self.max_bytes:
            return False
        for b in range(1, blocks):  # entries this one holds whole
            for entry in list(self.index.get(hashes[b - 1], ())):
                if len(entry.ids) == b * BLOCK and entry.ids == ids[:b * BLOCK]:
                    self._drop(entry)
        while self.nbytes + size > self.max_bytes:
            self._drop(next(iter(self.entries)))
        entry = Entry(ids, [_own(k[:, :m]) for k in keys], [_own(v[:, :m]) for v in values], _own(hidden[:m]), hashes)
        self.entries[entry] = None
        for h in hashes:
            self.index.setdefault(h, []).append(entry)
        self.nbytes += entry.nbytes
        return True

    def _drop(self, entry: Entry) -> None:
        del self.entries[entry]
        for h in entry.hashes:
            bucket = self.index[h]
            bucket.remove(entry)
            if not bucket:
                del self.index[h]
        self.nbytes -= entry.nbytes

    def clear(self) -> None:
        self.entries.clear()
        self.index.clear()
        self.nbytes = 0
