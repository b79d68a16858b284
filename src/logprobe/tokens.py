"""Token ids <-> text, and each token's own bytes.

The API reports a token as "the text of the single token": its bytes decoded as UTF-8, or
`bytes:\\xe2\\x80` when they are a piece of a multi-byte character. Those bytes are computed once per
model for the whole vocabulary (`TokenTable`), so formatting a response never calls the tokenizer.
"""

from __future__ import annotations

import codecs
import functools
import re
from dataclasses import dataclass

import numpy as np

_SPM_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's byte -> printable-unicode map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    byte_values, codepoints = printable[:], printable[:]
    extra = 0
    for b in range(256):
        if b not in byte_values:
            byte_values.append(b)
            codepoints.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(byte_values, codepoints)}


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.decoder is None:
        return False
    return "ByteLevel" in repr(backend.decoder)


def token_string(raw: bytes) -> str:
    """The API's string for one token's bytes."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


@dataclass
class TokenTable:
    """Per-token bytes and API strings for every id of the vocabulary."""

    token_bytes: list[bytes]
    strings: np.ndarray  # object array of str, indexed by token id
    special_ids: frozenset[int]
    skipped_ids: frozenset[int] = frozenset()  # what generated text leaves out (skip_special_tokens)

    @classmethod
    def build(cls, tokenizer, vocab_size: int) -> "TokenTable":
        special_ids = frozenset(int(i) for i in tokenizer.all_special_ids)
        added_tokens = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        added = {int(i) for i in added_tokens}
        # generated text leaves out the named special tokens and every added token marked special (SmolLM2's
        # <repo_name>, ...), as decode(skip_special_tokens=True) does
        skipped_ids = special_ids | frozenset(int(i) for i, t in added_tokens.items() if getattr(t, "special", False))
        pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
        byte_level = _is_byte_level(tokenizer)
        table = _gpt2_unicode_to_byte() if byte_level else None
        token_bytes: list[bytes] = []
        for tid, piece in enumerate(pieces):
            if piece is None:
                token_bytes.append(b"")
            elif tid in added or tid in special_ids:
                token_bytes.append(piece.encode("utf-8"))
            elif table is not None:
                try:
                    token_bytes.append(bytes(table[ch] for ch in piece))
                except KeyError:
                    token_bytes.append(piece.encode("utf-8"))
            else:
                m = _SPM_BYTE.match(piece)
                if m:
                    token_bytes.append(bytes([int(m.group(1), 16)]))
                else:
                    token_bytes.append(piece.replace("\u2581", " ").encode("utf-8"))
        # A model's embedding matrix may be larger than its tokenizer (padding rows): empty tokens.
        token_bytes.extend(b"" for _ in range(vocab_size - len(token_bytes)))
        strings = np.empty(vocab_size, dtype=object)
        strings[:] = [token_string(b) for b in token_bytes]
        return cls(token_bytes, strings, special_ids, skipped_ids)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token stands for."""
        return max((len(b) for b in self.token_bytes), default=1)

    def text_bytes(self, token_id: int) -> bytes:
        """The bytes a token contributes to a decoded text (special tokens contribute none)."""
        return b"" if token_id in self.special_ids else self.token_bytes[token_id]


class TextAssembler:
    """Builds the text of a token sequence one token at a time and records each token's character
    offset in it. Bytes go through an incremental UTF-8 decoder, so a character split over two tokens
    appears once, at the offset where its first token starts."""

    def __init__(self, table: TokenTable, start: int = 0):
        self._table = table
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.parts: list[str] = []
        self.length = start
        self.offsets: list[int] = []

    @property
    def table(self) -> TokenTable:
        return self._table

    def add(self, token_id: int, special_text: bool = False, silent: bool = False) -> str:
        """Append a token's text; a special token adds its own text only with `special_text` (an
        echoed prompt spells its special tokens, generated text does not); a `silent` one adds none
        (generated text's skip_special_tokens)."""
        if silent:
            raw = b""
        else:
            raw = self._table.token_bytes[token_id] if special_text else self._table.text_bytes(token_id)
        pending = self._decoder.getstate()[0]
        piece = self._decoder.decode(raw)
        offset = self.length
        if pending and piece.startswith("\ufffd") and raw and not 0x80 <= raw[0] <= 0xBF:
            # The earlier bytes never became a character: their replacement character belongs to the
            # token that brought them, not to this one.
            offset += 1
        self.offsets.append(offset)
        self.parts.append(piece)
        self.length += len(piece)
        return piece

    def finish(self) -> str:
        piece = self._decoder.decode(b"", final=True)
        self.parts.append(piece)
        self.length += len(piece)
        return piece

    @property
    def text(self) -> str:
        return "".join(self.parts)
