"""`prompt_logprobs` straight from numpy columns to JSON bytes.

A whole-vocabulary answer is millions of entries (256 positions x 49,152 tokens = 12.6 M), each
`"ID":{"logprob":X,"rank":R,"decoded_token":"TEXT"}`. Building a Python dict per entry and calling a
JSON encoder costs seconds and gigabytes; here each entry is assembled by one numpy gather:

  * per model, once: every token's `"ID":{"logprob":` and `,"decoded_token":"TEXT"}` pieces, JSON-escaped,
    laid end to end in one byte buffer;
  * per block of entries: the numbers are printed by orjson from a float64 / int64 array in one call, and
    a gather index copies `sep, key piece, number, ',"rank":', rank, text piece, close` for every entry
    into the output buffer.

Blocks are yielded as they are built, so the server streams the answer with memory bounded by one block.
"""

from __future__ import annotations

import base64
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import orjson

from .logprobs import wire_floats

BLOCK_ENTRIES = 1 << 16  # entries encoded per yielded block
ENCODE_THREADS = 2  # whole-vocabulary rows encoded at once (memory: a few MB per row)
_STATIC = [b"", b",", b"{", b",{", b"}", b',"rank":']
_EMPTY, _COMMA, _OPEN, _COMMA_OPEN, _CLOSE, _RANK = range(len(_STATIC))


def _concat(pieces: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
    starts = np.cumsum(lengths) - lengths
    return np.frombuffer(b"".join(pieces), dtype=np.uint8), starts, lengths


def _number_spans(encoded: bytes, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """orjson's `[a,b,c]` -> (bytes, start of each number, its length)."""
    buf = np.frombuffer(encoded, dtype=np.uint8)
    commas = np.flatnonzero(buf == ord(","))
    starts = np.empty(count, dtype=np.int64)
    ends = np.empty(count, dtype=np.int64)
    starts[0], ends[-1] = 1, len(buf) - 1
    starts[1:] = commas + 1
    ends[:-1] = commas
    return buf, starts, ends - starts


_ARANGE = np.arange(0, dtype=np.int64)


def _arange(n: int) -> np.ndarray:
    """A cached 0..n-1 (the gather index is a per-segment offset plus this)."""
    global _ARANGE
    if _ARANGE.size < n:
        _ARANGE = np.arange(max(n, 2 * _ARANGE.size), dtype=np.int64)
    return _ARANGE[:n]


def _gather(src: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> bytes:
    """Concatenate src[starts[i]:starts[i] + lengths[i]] for every i, as bytes."""
    out_starts = np.cumsum(lengths) - lengths
    total = int(out_starts[-1] + lengths[-1]) if len(lengths) else 0
    index = np.repeat(starts - out_starts, lengths)
    index += _arange(total)
    return src[index].tobytes()


def _padded_numbers(encoded: bytes, count: int) -> np.ndarray:
    """orjson's `[a,b,c]` -> a [count, width] matrix of the numbers' bytes, left-aligned and padded
    with spaces to the widest."""
    buf, starts, lengths = _number_spans(encoded, count)
    width = int(lengths.max())
    cols = np.arange(width)
    index = np.minimum(starts[:, None] + cols, len(buf) - 1)
    return np.where(cols < lengths[:, None], buf[index], np.uint8(32))


SKELETON_COUNT = 8  # whole-vocabulary row skeletons kept per encoder ...
SKELETON_BYTES = 160 * 1024 * 1024  # ... and the most bytes they may hold together (one is always kept)


class PromptLogprobsEncoder:
    """Per-model encoder of `prompt_logprobs` maps (built once per model and naming mode)."""

    def __init__(self, names: list[str]):
        vocab = len(names)
        keys = [b'"%d":{"logprob":' % i for i in range(vocab)]
        texts = [b',"decoded_token":' + orjson.dumps(n) + b"}" for n in names]
        static = b"".join(_STATIC)
        static_len = np.array([len(s) for s in _STATIC], dtype=np.int64)
        self._static_start = np.cumsum(static_len) - static_len
        self._static_len = static_len
        key_buf, key_start, key_len = _concat(keys)
        text_buf, text_start, text_len = _concat(texts)
        self._key_start = key_start + len(static)
        self._key_len = key_len
        self._text_start = text_start + len(static) + len(key_buf)
        self._text_len = text_len
        self._model_buf = np.concatenate([np.frombuffer(static, dtype=np.uint8), key_buf, text_buf])
        # A whole-vocabulary row in id order: `,{"0":{"logprob":` N `,"rank":` R `,"decoded_token":..}`
        # then `,"1":{"logprob":` ... `}}`. Its fixed pieces are laid out once per number width as a
        # skeleton with blank holes; a row is the skeleton with its numbers written into the holes.
        self._heads = [(b",{" if i == 0 else b",") + keys[i] for i in range(vocab)]
        self._tails = texts[:-1] + [texts[-1] + b"}"]
        self._fixed_bytes = sum(map(len, self._heads)) + sum(map(len, self._tails))
        self._skeletons: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    def skeleton_bytes(self) -> int:
        """Memory held by the cached row skeletons and their hole indexes."""
        return sum(a.nbytes + b.nbytes + c.nbytes for a, b, c in self._skeletons.values())

    def _skeleton(self, width_val: int, width_rank: int):
        """(skeleton bytes, flat index of every value hole byte, of every rank hole byte)."""
        key = (width_val, width_rank)
        with self._lock:  # rows are encoded on a small pool of threads
            found = self._skeletons.pop(key, None)
            if found is None:
                # The least recently used go first while SKELETON_COUNT are kept or their bytes would pass
                # SKELETON_BYTES (a 262,144-token row's skeleton with its indexes is ~73 MiB; SmolLM2's
                # ~14). A row's widths vary only with its longest number, so a few serve most rows.
                holes = len(self._heads) * (width_val + width_rank)
                new_bytes = self._fixed_bytes + len(self._heads) * len(_STATIC[_RANK]) + holes * 9  # 8-byte indexes
                while self._skeletons and (len(self._skeletons) >= SKELETON_COUNT
                                           or self.skeleton_bytes() + new_bytes > SKELETON_BYTES):
                    self._skeletons.pop(next(iter(self._skeletons)))
                found = self._build_skeleton(width_val, width_rank)
            self._skeletons[key] = found  # most recently used last
            return found

    def _build_skeleton(self, width_val: int, width_rank: int):
        blank_val, blank_rank, rank_piece = b" " * width_val, b" " * width_rank, _STATIC[_RANK]
        pieces = []
        for head, tail in zip(self._heads, self._tails):
            pieces += (head, blank_val, rank_piece, blank_rank, tail)
        lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
        starts = (np.cumsum(lengths) - lengths).reshape(-1, 5)
        val_index = (starts[:, 1:2] + np.arange(width_val)).ravel()
        rank_index = (starts[:, 3:4] + np.arange(width_rank)).ravel()
        return np.frombuffer(b"".join(pieces), dtype=np.uint8), val_index, rank_index

    def encode_rows(self, ids: np.ndarray, lps: np.ndarray, ranks: np.ndarray, row_starts: np.ndarray,
                    first_row_opens_list: bool) -> bytes:
        """Encode consecutive maps. Entry j belongs to the row whose start (index into ids) is the last
        row_start <= j; each row becomes `{...}` and rows are separated by commas (a leading comma too
        unless `first_row_opens_list`)."""
        n = len(ids)
        vals_buf, vals_start, vals_len = _number_spans(orjson.dumps(wire_floats(lps), option=orjson.OPT_SERIALIZE_NUMPY), n)
        rank_buf, rank_start, rank_len = _number_spans(orjson.dumps(np.ascontiguousarray(ranks, dtype=np.int64),
                                                                    option=orjson.OPT_SERIALIZE_NUMPY), n)
        base = len(self._model_buf)
        src = np.concatenate([self._model_buf, vals_buf, rank_buf])
        sep = np.full(n, _COMMA, dtype=np.int64)
        sep[row_starts] = _COMMA_OPEN
        if first_row_opens_list and len(row_starts):
            sep[row_starts[0]] = _OPEN
        close = np.full(n, _EMPTY, dtype=np.int64)
        close[np.append(row_starts[1:] - 1, n - 1)] = _CLOSE
        starts = np.stack([
            self._static_start[sep], self._key_start[ids], vals_start + base,
            np.full(n, self._static_start[_RANK]), rank_start + base + len(vals_buf),
            self._text_start[ids], self._static_start[close]], axis=1).ravel()
        lengths = np.stack([
            self._static_len[sep], self._key_len[ids], vals_len, np.full(n, self._static_len[_RANK]),
            rank_len, self._text_len[ids], self._static_len[close]], axis=1).ravel()
        return _gather(src, starts, lengths)

    def iter_topk(self, prompt_ids: np.ndarray, own_lps: np.ndarray, own_ranks: np.ndarray,
                  top_ids: np.ndarray, top_lps: np.ndarray, top_ranks: np.ndarray) -> Iterator[bytes]:
        """`[null, {own + top-k}, ...]` for prompt_logprobs k >= 0: the prompt's token first, then the
        k likeliest that are not it (k or k + 1 entries)."""
        num, k = top_ids.shape
        yield b"[null"
        if num <= 1:
            yield b"]"
            return
        ids = np.concatenate([prompt_ids[1:, None], top_ids[1:]], axis=1)
        lps = np.concatenate([own_lps[1:, None], top_lps[1:]], axis=1)
        ranks = np.concatenate([own_ranks[1:, None], top_ranks[1:]], axis=1)
        keep = np.ones(ids.shape, dtype=bool)
        keep[:, 1:] = top_ids[1:] != prompt_ids[1:, None]
        per_row = max(1, BLOCK_ENTRIES // (k + 1))
        for r0 in range(0, num - 1, per_row):
            m = keep[r0:r0 + per_row]
            counts = m.sum(axis=1)
            row_starts = np.cumsum(counts) - counts
            yield self.encode_rows(ids[r0:r0 + per_row][m], lps[r0:r0 + per_row][m],
                                   ranks[r0:r0 + per_row][m], row_starts, first_row_opens_list=False)
        yield b"]"

    def encode_vocab_row(self, lps: np.ndarray, ranks: np.ndarray) -> bytes:
        """`,{...}` for one position: every token of the vocabulary, in id order. Numbers are padded
        with spaces to the widest of the row (JSON allows whitespace after a value), so the row is
        the cached skeleton with two scatters instead of a gather per byte."""
        vocab = len(lps)
        vals = _padded_numbers(orjson.dumps(wire_floats(lps), option=orjson.OPT_SERIALIZE_NUMPY), vocab)
        rank = _padded_numbers(orjson.dumps(np.ascontiguousarray(ranks, dtype=np.int64),
                                            option=orjson.OPT_SERIALIZE_NUMPY), vocab)
        skeleton, val_index, rank_index = self._skeleton(vals.shape[1], rank.shape[1])
        out = skeleton.copy()
        out[val_index] = vals.ravel()
        out[rank_index] = rank.ravel()
        return out.tobytes()

    def iter_vocab(self, full: np.ndarray, ranks: np.ndarray) -> Iterator[bytes]:
        """`[null, {every token}, ...]` for prompt_logprobs -1, from the [P, V] log probabilities and
        their ranks. Two positions are encoded at a time on a small pool (numpy releases the GIL)."""
        yield b"[null"
        rows = range(1, full.shape[0])
        with ThreadPoolExecutor(max_workers=ENCODE_THREADS) as pool:
            pending = deque()
            for pos in rows:
                pending.append(pool.submit(self.encode_vocab_row, full[pos], ranks[pos]))
                if len(pending) > ENCODE_THREADS:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        yield b"]"


def iter_dense(prompt_ids: np.ndarray, own_lps: np.ndarray, own_ranks: np.ndarray, full: np.ndarray,
               encoding: str) -> Iterator[bytes]:
    """The dense form of prompt_logprobs -1: per position `{"token_id", "logprob", "rank", "logprobs":
    base64 of the little-endian float32/float16 array of all vocab log probabilities}`."""
    dtype = np.dtype("<f4") if encoding == "float32" else np.dtype("<f2")
    yield b"[null"
    own = wire_floats(own_lps).tolist()
    for pos in range(1, full.shape[0]):
        head = orjson.dumps({"token_id": int(prompt_ids[pos]), "logprob": own[pos], "rank": int(own_ranks[pos])})
        data = base64.b64encode(np.ascontiguousarray(full[pos], dtype=dtype).tobytes())
        yield b"," + head[:-1] + b',"logprobs":"' + data + b'"}'
    yield b"]"
