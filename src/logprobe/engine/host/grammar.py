"""Grammars for constrained decoding, with llguidance: a `Constraint` (backend/) compiled once per
(model, constraint), then one `GrammarState` per sequence that says which tokens may come next.

llguidance walks a trie of the model's token bytes, so its tokenizer is built from the `TokenTable`
(every token's bytes, computed once per model): the same masks as its own transformers adapter,
but for any tokenizer the table was built from (GGUF, sentencepiece, a test's byte tokenizer). The
model's vocabulary may be larger than its tokenizer's (padding rows of the embedding): those ids are
never allowed. The stop tokens the model ends a text with count as llguidance's end-of-sequence:
allowed exactly where the text so far is complete.

No torch here: the API compiles a request's constraint before anything is held (a 400 that names the
param), and in one process the engine then finds it compiled.
"""

from __future__ import annotations

import bisect
import functools
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import numpy as np

from ...backend import Constraint
from ...tokens import TokenTable
from .forced import ForcedTokens

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)


class GrammarError(ValueError):
    """A constraint that does not compile; the message says why (llguidance's own words)."""


class TokenNotAllowed(ValueError):
    """`GrammarState.advance` was given a token the grammar did not allow."""


# ---- the model's vocabulary as llguidance reads it --------------------------------------------------


class _TableTokens:
    """What `llguidance.TokenizerWrapper` reads of a tokenizer: each token's bytes, the special ids, and
    an encoder (llguidance spells a text the grammar forces with it)."""

    def __init__(self, table: TokenTable, num_tokens: int, eos_id: int, bos_id: int | None, encode):
        self.tokens = table.token_bytes[:num_tokens]
        self.special_token_ids = sorted(i for i in table.special_ids if i < num_tokens)
        self.eos_token_id = eos_id
        self.bos_token_id = bos_id
        self._encode = encode

    def __call__(self, text: bytes) -> list[int]:
        return list(self._encode(text.decode("utf-8", errors="replace")))


@dataclass(eq=False)
class GrammarVocab:
    """One model's vocabulary for llguidance: its tokenizer and the model's vocabulary size (the width
    of every mask)."""

    tokenizer: llguidance.LLTokenizer
    vocab_size: int  # the model's: masks are [vocab_size]
    num_tokens: int  # the tokenizer's: ids from here on are padding, never allowed
    stop_ids: tuple[int, ...]
    table: TokenTable

    @functools.cached_property
    def spellings(self) -> tuple[dict[bytes, list[int]], list[bytes], list[int]]:
        """The text tokens (not special, not empty) by their bytes, and the same sorted by bytes (ids
        alongside), to find the tokens that spell a forced text's start or start with all of it."""
        by_bytes: dict[bytes, list[int]] = {}
        for i, raw in enumerate(self.table.token_bytes[:self.num_tokens]):
            if raw and i not in self.table.special_ids:
                by_bytes.setdefault(raw, []).append(i)
        ordered = sorted((raw, i) for raw, ids in by_bytes.items() for i in ids)
        return by_bytes, [raw for raw, _ in ordered], [i for _, i in ordered]


_vocabs: dict[int, tuple[TokenTable, GrammarVocab]] = {}
_vocabs_lock = threading.Lock()


def vocab_for(table: TokenTable, stop_ids, tokenizer) -> GrammarVocab:
    """The llguidance vocabulary of the model whose token table this is (built once per table, 0.1-0.3 s
    for 49k tokens). `stop_ids`: the tokens that end a text (the first is the end-of-sequence);
    `tokenizer`: the model's (transformers') tokenizer, which the table was built from: llguidance
    spells forced text with it, and without it its masks there are wrong."""
    with _vocabs_lock:
        found = _vocabs.get(id(table))
        if found is not None and found[0] is table:
            return found[1]
    vocab_size = len(table.token_bytes)
    num_tokens = min(vocab_size, len(tokenizer))
    stop_ids = tuple(dict.fromkeys(int(i) for i in stop_ids if 0 <= int(i) < num_tokens))
    if not stop_ids:
        raise GrammarError("the model has no end-of-text token inside its tokenizer's vocabulary")
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    bos = getattr(tokenizer, "bos_token_id", None)
    wrapper = llguidance.TokenizerWrapper(_TableTokens(table, num_tokens, stop_ids[0], bos, encode))
    # One end-of-sequence for llguidance (1.3 and older refuse a list); GrammarState allows the other
    # stop tokens wherever it allows that one.
    built = GrammarVocab(llguidance.LLTokenizer(wrapper, n_vocab=num_tokens, eos_token=stop_ids[0]),
                         vocab_size, num_tokens, stop_ids, table)
    with _vocabs_lock:
        _vocabs[id(table)] = (table, built)
    return built


def vocab_of_model(model) -> GrammarVocab:
    """`vocab_for` of anything with `table`, `info` (ModelInfo) and `tokenizer`: a `Backend` on the API's
    side, the `Engine` on the engine's."""
    info = model.info
    stops = [info.eos_token_id] if info.eos_token_id is not None else []
    stops += sorted(info.stop_token_ids)
    return vocab_for(model.table, stops, model.tokenizer)


# ---- compiling ---------------------------------------------------------------------------------------


def grammar_text(constraint: Constraint) -> str:
    """The constraint as llguidance's grammar text (no tokenizer needed; not yet checked)."""
    kind, source = constraint.kind, constraint.source
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(source)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(source)
        if kind == "choice":
            choices = json.loads(source)
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        if kind == "grammar":
            return llguidance.grammar_from("grammar", source)  # Lark, or GBNF (converted to Lark)
    except ValueError as exc:
        raise GrammarError(str(exc)) from None
    raise GrammarError(f"unknown constraint kind {kind!r} (one of {', '.join(KINDS)})")


@dataclass(eq=False)
class CompiledGrammar:
    """A constraint compiled for one model: a matcher at the start of the text, copied per sequence."""

    constraint: Constraint
    vocab: GrammarVocab
    start: llguidance.LLMatcher
    compile_seconds: float


class _Cache:
    """Compiled grammars per (model vocabulary, constraint), least recently used dropped first, with
    the numbers /metrics shows."""

    def __init__(self, size: int):
        self.size = size
        self.entries: OrderedDict[tuple[int, Constraint], CompiledGrammar] = OrderedDict()
        self.lock = threading.Lock()
        self.hits = self.misses = 0
        self.compile_seconds = 0.0  # summed over the misses

    def get(self, constraint: Constraint, vocab: GrammarVocab) -> CompiledGrammar:
        key = (id(vocab), constraint)
        with self.lock:
            found = self.entries.get(key)
            if found is not None and found.vocab is vocab:
                self.entries.move_to_end(key)
                self.hits += 1
                return found
        compiled = _compile(constraint, vocab)  # outside the lock: llguidance releases the GIL
        with self.lock:
            self.misses += 1
            self.compile_seconds += compiled.compile_seconds
            self.entries[key] = compiled
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)
        return compiled


_cache = _Cache(CACHE_SIZE)


def _compile(constraint: Constraint, vocab: GrammarVocab) -> CompiledGrammar:
    started = time.perf_counter()
    text = grammar_text(constraint)
    try:
        matcher = llguidance.LLMatcher(vocab.tokenizer, text, log_level=0)
    except (ValueError, RuntimeError) as exc:  # some versions raise on a bad grammar
        raise GrammarError(str(exc)) from None
    if matcher.is_error():
        raise GrammarError(matcher.get_error())
    return CompiledGrammar(constraint, vocab, matcher, time.perf_counter() - started)


def grammar_for(constraint: Constraint, vocab: GrammarVocab) -> CompiledGrammar:
    """The constraint compiled for this vocabulary, from the cache when it was compiled before; raises
    GrammarError when it does not compile."""
    return _cache.get(constraint, vocab)


def cache_stats() -> dict:
    """{"hits", "misses", "entries", "compile_seconds"} of the process's grammar cache."""
    with _cache.lock:
        return {"hits": _cache.hits, "misses": _cache.misses, "entries": len(_cache.entries),
                "compile_seconds": _cache.compile_seconds}


# ---- one sequence ------------------------------------------------------------------------------------


class GrammarState:
    """Where one sequence is in its grammar: which tokens may come next, and whether the text so far is
    complete. Not thread-safe: one sequence is advanced by one thread at a time."""

    def __init__(self, compiled: CompiledGrammar):
        self.vocab = compiled.vocab
        self._matcher = compiled.start.deep_copy()
        self._words = np.empty((self.vocab.num_tokens + 31) // 32, dtype=np.int32)  # llguidance's bitmask

    def allowed(self) -> np.ndarray:
        """[vocab_size] bool over the model's vocabulary: the tokens that keep the text inside the
        grammar (a stop token where it is complete; padding ids never)."""
        out = np.zeros(self.vocab.vocab_size, dtype=bool)
        self.allowed_into(out)
        return out

    def allowed_into(self, out: np.ndarray) -> None:
        """`allowed()` written into a [vocab_size] bool row (a batch's mask, without a new array)."""
        self._own_into(out)
        if np.count_nonzero(out) <= 1:  # one token: maybe llguidance's spelling of a forced text
            self._add_other_spellings(out)
        self._with_stops(out)

    def sets(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(allowed, drawn): `allowed()`, and the tokens a generation may draw where they are fewer, else
        None. Where the grammar forces a text, a token is drawn from llguidance's own mask, the first
        token of the tokenizer's spelling of that text; the other spellings still count in the mass the
        constraint keeps (docs/performance.md, "Constrained decoding: the allowed set", measured)."""
        allowed = np.zeros(self.vocab.vocab_size, dtype=bool)
        self._own_into(allowed)
        drawn = None
        if np.count_nonzero(allowed) <= 1:
            own = allowed.copy()
            self._add_other_spellings(allowed)
            # llguidance allows nothing where its spelling of the forced text is not settled yet (" " after
            # "maybe" in "maybe so|maybe not"): there every spelling the parser accepts may be drawn
            if np.count_nonzero(own) == 1 and np.count_nonzero(allowed) > 1:
                drawn = self._with_stops(own)
        return self._with_stops(allowed), drawn

    def _own_into(self, out: np.ndarray) -> None:
        """llguidance's mask, over the model's vocabulary (padding ids never allowed)."""
        self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")
        out[:self.vocab.num_tokens] = bits[:self.vocab.num_tokens]
        out[self.vocab.num_tokens:] = False

    def _with_stops(self, out: np.ndarray) -> np.ndarray:
        """Every stop token where llguidance allows its one end-of-sequence."""
        if len(self.vocab.stop_ids) > 1 and out[self.vocab.stop_ids[0]]:
            out[list(self.vocab.stop_ids)] = True
        return out

    def _add_other_spellings(self, out: np.ndarray) -> None:
        """Where the grammar forces a text, llguidance allows only the first token of the tokenizer's
        own spelling of it (after "may" in "maybe so": "be", not "b"), though the parser takes every
        token that keeps the text inside. The allowed set here is the grammar's: those tokens too (the
        mass the constraint keeps is then the model's whole probability of staying inside)."""
        forced = self._matcher.compute_ff_bytes()
        if not forced:
            return
        by_bytes, ordered, ids = self.vocab.spellings
        for end in range(1, len(forced) + 1):  # tokens inside the forced text: always allowed
            out[by_bytes.get(forced[:end], [])] = True
        start = bisect.bisect_right(ordered, forced)  # tokens that go on past it: as the parser says
        for at in range(start, len(ordered)):
            if not ordered[at].startswith(forced):
                break
            if self._matcher.validate_tokens([ids[at]]) == 1:
                out[ids[at]] = True

    def advance(self, token: int) -> None:
        """The sequence took `token`; raises TokenNotAllowed when the grammar did not allow it."""
        token = int(token)
        if token in self.vocab.stop_ids[1:] and self.is_accepting:
            token = self.vocab.stop_ids[0]  # the text ends: as llguidance's end-of-sequence
        if not 0 <= token < self.vocab.num_tokens or not self._matcher.consume_token(token):
            raise TokenNotAllowed(f"token {token} is not allowed here by the grammar")

    @property
    def is_accepting(self) -> bool:
        """The text so far is complete: it may end here (a stop token is allowed)."""
        return self._matcher.is_accepting()

    @property
    def is_finished(self) -> bool:
        """Nothing but a stop token may follow."""
        return self._matcher.is_stopped()


def new_state(constraint: Constraint, model) -> GrammarState | ForcedTokens:
    """A sequence's state at the start of its text (the compile is cached). `model`: a GrammarVocab, or
    what `vocab_of_model` takes (the engine). A "tokens" constraint (one sequence of a decided choice,
    forced.py) spells its tokens: no grammar to compile."""
    vocab = model if isinstance(model, GrammarVocab) else vocab_of_model(model)
    if constraint.kind == "tokens":
        return ForcedTokens(json.loads(constraint.source), vocab.vocab_size, vocab.stop_ids)
    return GrammarState(grammar_for(constraint, vocab))


# ---- a given text ------------------------------------------------------------------------------------


@dataclass
class TextCheck:
    """A token sequence read under a constraint: `masks[i]` is the allowed set before token i; reading
    stopped at `first_bad` (None: every token was allowed)."""

    masks: np.ndarray  # [checked, vocab_size] bool: rows for the tokens up to and including the first bad one
    first_bad: int | None
    is_complete: bool  # every token was allowed and the text may end there


def check_text(constraint: Constraint, token_ids, vocab: GrammarVocab) -> TextCheck:
    """Read `token_ids` under the constraint from its start, keeping the allowed set at every position
    (scoring under a constraint)."""
    state = new_state(constraint, vocab)
    masks = np.zeros((len(token_ids), vocab.vocab_size), dtype=bool)
    for i, token in enumerate(token_ids):
        state.allowed_into(masks[i])
        if not masks[i, int(token)]:
            return TextCheck(masks[:i + 1], i, False)
        state.advance(token)
    return TextCheck(masks, None, state.is_accepting)
