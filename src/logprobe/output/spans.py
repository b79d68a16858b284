"""Several tokenizations of one text, aligned on the text itself (POST /v1/compare with `align: "text"`).

A tokenization has a boundary at every byte offset where one of its tokens ends. The spans are the
coarsest common segmentation: the text is cut at the byte offsets that are a boundary of every
tokenization and also a character boundary of the text's UTF-8, and nowhere else. So each token lies
inside exactly one span (no cut falls strictly inside a token), and each span is whole characters even
where byte-level tokens split a character (a cut both tokenizers make inside a character is not taken).
A span's log probability in a model is then the sum of its tokens' log probabilities in that model's
own tokenization. Tokens here are byte strings; a special token written in the text counts as its own
text, since the tokenizer read those characters as that one token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class Misspelled(ValueError):
    """A tokenization whose bytes are not the text's: `which` tokenization, first differing byte `at`."""

    def __init__(self, which: int, at: int):
        super().__init__(f"tokenization {which} differs from the text at byte {at}")
        self.which, self.at = which, at


@dataclass
class Alignment:
    bounds: np.ndarray  # [S + 1] int64 byte offsets of the spans' edges: 0, ..., num_bytes
    char_bounds: np.ndarray  # [S + 1] int64 the same edges as character offsets
    token_spans: list[np.ndarray]  # per tokenization, [T] int64: the span each token lies in
    token_bytes: list[np.ndarray]  # per tokenization, [T] int64: the byte offset where each token starts

    @property
    def num_spans(self) -> int:
        return len(self.bounds) - 1

    def span_sums(self, which: int, values: np.ndarray) -> np.ndarray:
        """[S] float64: per span, the sum of tokenization `which`'s values of its tokens (-inf stays -inf)."""
        values = np.asarray(values, dtype=np.float64)
        spans = self.token_spans[which]
        out = np.zeros(self.num_spans, dtype=np.float64)
        np.add.at(out, spans, values)  # unbuffered: every token of a span is added
        return out

    def span_counts(self, which: int) -> np.ndarray:
        """[S] int64: how many of tokenization `which`'s tokens lie in each span."""
        return np.bincount(self.token_spans[which], minlength=self.num_spans).astype(np.int64)


def align(text: str, tokenizations: list[list[bytes]]) -> Alignment:
    """The spans of `text` on which every tokenization (a list of each token's bytes) has a boundary;
    Misspelled if a tokenization's bytes, joined, are not the text's UTF-8."""
    data = text.encode("utf-8")
    size = len(data)
    codes = np.frombuffer(data, dtype=np.uint8)
    is_char_start = np.ones(size + 1, dtype=bool)  # offset size (the end) is a boundary too
    is_char_start[:size] = (codes & 0xC0) != 0x80  # not a continuation byte
    common = is_char_start.copy()
    starts = []
    for which, pieces in enumerate(tokenizations):
        check_spelling(which, pieces, data)
        lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
        ends = np.cumsum(lengths)
        own = np.zeros(size + 1, dtype=bool)
        own[0] = True
        own[ends] = True
        common &= own
        starts.append(ends - lengths)
    bounds = np.flatnonzero(common).astype(np.int64)
    char_offsets = np.concatenate([[0], np.cumsum(is_char_start[:size])]).astype(np.int64)
    last = max(len(bounds) - 2, 0)
    spans = [np.minimum(np.searchsorted(bounds, s, side="right") - 1, last).astype(np.int64) for s in starts]
    return Alignment(bounds, char_offsets[bounds], spans, starts)


def check_spelling(which: int, pieces: list[bytes], data: bytes) -> None:
    joined = b"".join(pieces)
    if joined != data:
        at = next((i for i, (x, y) in enumerate(zip(joined, data)) if x != y), min(len(joined), len(data)))
        raise Misspelled(which, at)
