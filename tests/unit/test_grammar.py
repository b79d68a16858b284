"""engine/host/grammar.py: constraints compiled with llguidance on the bundled SmolLM2 tokenizer, the cache,
and every allowed set checked against one computed here from the tokens' bytes alone (which tokens keep
the text a prefix of a choice; which keep it inside [0-9]*)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from fake_backend import TinyTokenizer
from logprobe.backend import Constraint
from logprobe.engine.host import grammar
from logprobe.tokens import TokenTable

PADDING = 64  # the model's vocabulary is larger than the tokenizer's by this many padding ids
STOP = 2  # SmolLM2's <|im_end|>, its end-of-sequence


@pytest.fixture(scope="module")
def table(tokenizer):
    return TokenTable.build(tokenizer, len(tokenizer) + PADDING)


@pytest.fixture(scope="module")
def vocab(table, tokenizer):
    return grammar.vocab_for(table, [STOP], tokenizer)


def text_tokens(table) -> list[tuple[int, bytes]]:
    """(id, bytes) of every token that is text: not special, not empty, not padding."""
    return [(i, b) for i, b in enumerate(table.token_bytes) if b and i not in table.special_ids]


def expected_for_choices(table, choices: list[bytes], prefix: bytes) -> np.ndarray:
    """The tokens after which the text is still a prefix of a choice, and the stop token where the text
    is a whole choice."""
    out = np.zeros(len(table.token_bytes), dtype=bool)
    for i, piece in text_tokens(table):
        out[i] = any(c.startswith(prefix + piece) for c in choices)
    out[STOP] = prefix in choices
    return out


def expected_digits(table) -> np.ndarray:
    """[0-9]* is complete after any digits: every all-digit token, and the stop token."""
    out = np.zeros(len(table.token_bytes), dtype=bool)
    for i, piece in text_tokens(table):
        out[i] = all(48 <= c <= 57 for c in piece)
    out[STOP] = True
    return out


def token_id(table, piece: str) -> int:
    return int(np.flatnonzero(table.strings == piece)[0])


@pytest.mark.parametrize("pieces", [None, ["ma", "y", "b", "e", " n", "o", "t"], ["m", "ay", "be", " not"]])
def test_choice_allowed_sets_follow_the_prefixes(table, vocab, tokenizer, pieces):
    """Along the tokenizer's own spelling and along others: where the grammar forces a text ("be" after
    "may"), every token that keeps the text a prefix of a choice is allowed, not only the tokenizer's."""
    choices = ["yes", "no", "maybe so", "maybe not"]
    raw = [c.encode() for c in choices]
    state = grammar.new_state(Constraint("choice", json.dumps(choices)), vocab)
    text = b""
    path = (tokenizer("maybe not", add_special_tokens=False).input_ids if pieces is None
            else [token_id(table, p) for p in pieces])
    for token in path:
        allowed = state.allowed()
        assert allowed.shape == (len(tokenizer) + PADDING,)
        np.testing.assert_array_equal(allowed, expected_for_choices(table, raw, text))
        assert not allowed[len(tokenizer):].any()  # padding ids, never
        assert not state.is_accepting
        state.advance(token)
        text += table.token_bytes[token]
    np.testing.assert_array_equal(state.allowed(), expected_for_choices(table, raw, text))
    assert state.is_accepting and state.is_finished
    assert np.flatnonzero(state.allowed()).tolist() == [STOP]


@pytest.mark.parametrize("pieces", [None, ["ma", "y", "b", "e", " n", "o", "t"], ["m", "ay", "be", " not"]])
def test_drawn_sets_keep_to_the_tokenizers_spelling_of_a_forced_text(table, vocab, tokenizer, pieces):
    """`sets()`: the allowed set as above, and where the grammar forces a text, the one token a
    generation may draw: the first of the tokenizer's own spelling of that text, encoded on its own
    ("be" after "may", not "b"); None (every allowed token) elsewhere, and where llguidance has no
    spelling of the forced text yet (" " after "maybe")."""
    choices = ["yes", "no", "maybe so", "maybe not"]
    raw = [c.encode() for c in choices]
    state = grammar.new_state(Constraint("choice", json.dumps(choices)), vocab)
    text, narrowed = b"", []
    path = (tokenizer("maybe not", add_special_tokens=False).input_ids if pieces is None
            else [token_id(table, p) for p in pieces])
    for token in path:
        allowed, drawn = state.sets()
        np.testing.assert_array_equal(allowed, expected_for_choices(table, raw, text))
        if drawn is not None:
            forced = os.path.commonprefix([c[len(text):] for c in raw if c.startswith(text)])
            first = tokenizer(forced.decode(), add_special_tokens=False).input_ids[0]
            assert forced and np.flatnonzero(drawn).tolist() == [first] and allowed.sum() > 1, text
            narrowed.append(text)
        state.advance(token)
        text += table.token_bytes[token]
    passes_may = b"may" in [b"".join(table.token_bytes[t] for t in path[:i]) for i in range(len(path))]
    assert (b"may" in narrowed) == passes_may  # "be" alone, where "b" keeps the text inside too
    allowed, drawn = state.sets()
    assert np.flatnonzero(allowed).tolist() == [STOP] and drawn is None


def test_digits_allowed_sets(table, vocab, tokenizer):
    state = grammar.new_state(Constraint("regex", "[0-9]*"), vocab)
    expected = expected_digits(table)
    assert 10 <= expected.sum() < 2000
    for token in tokenizer("2026", add_special_tokens=False).input_ids:
        np.testing.assert_array_equal(state.allowed(), expected)
        assert state.is_accepting
        state.advance(token)
    np.testing.assert_array_equal(state.allowed(), expected)


def test_a_byte_tokenizer_and_its_allowed_set():
    """The vocabulary comes from the token table, so a tokenizer that is not transformers' works too."""
    tiny = TinyTokenizer()
    table = TokenTable.build(tiny, 260)
    vocab = grammar.vocab_for(table, [tiny.eos_token_id], tiny)
    state = grammar.new_state(Constraint("regex", "[0-9]+"), vocab)
    assert np.flatnonzero(state.allowed()).tolist() == list(range(48, 58))  # not complete yet: no </s>
    state.advance(ord("7"))
    assert np.flatnonzero(state.allowed()).tolist() == list(range(48, 58)) + [tiny.eos_token_id]


def test_disallowed_and_padding_tokens_are_refused(table, vocab, tokenizer):
    state = grammar.new_state(Constraint("regex", "[0-9]*"), vocab)
    with pytest.raises(grammar.TokenNotAllowed):
        state.advance(len(tokenizer) + 3)  # a padding id
    state = grammar.new_state(Constraint("regex", "[0-9]*"), vocab)
    with pytest.raises(grammar.TokenNotAllowed):
        state.advance(tokenizer("abc", add_special_tokens=False).input_ids[0])


def test_cache_counts_hits_and_misses(vocab):
    constraint = Constraint("regex", "[a-c]{3}x")  # not compiled by any other test
    before = grammar.cache_stats()
    first = grammar.grammar_for(constraint, vocab)
    after_miss = grammar.cache_stats()
    assert after_miss["misses"] == before["misses"] + 1 and after_miss["hits"] == before["hits"]
    assert after_miss["compile_seconds"] >= before["compile_seconds"] + first.compile_seconds > before["compile_seconds"]
    second = grammar.grammar_for(constraint, vocab)
    grammar.new_state(constraint, vocab)
    after_hits = grammar.cache_stats()
    assert second is first
    assert after_hits["hits"] == after_miss["hits"] + 2 and after_hits["misses"] == after_miss["misses"]


def test_states_of_one_grammar_are_independent(vocab, tokenizer):
    constraint = Constraint("choice", json.dumps(["12", "34"]))
    one, two = grammar.new_state(constraint, vocab), grammar.new_state(constraint, vocab)
    one.advance(tokenizer("1", add_special_tokens=False).input_ids[0])
    assert not np.array_equal(one.allowed(), two.allowed())
    two.advance(tokenizer("3", add_special_tokens=False).input_ids[0])


@pytest.mark.parametrize("kind, source, words", [
    ("regex", "[0-9", "unclosed character class"),
    ("grammar", "start: foo", "unknown name"),
    ("json_schema", '{"type": "objectx"}', "objectx"),
    ("json_schema", "[1, 2", "expected"),
    ("xml", "<a/>", "unknown constraint kind"),
])
def test_grammars_that_do_not_compile(vocab, kind, source, words):
    with pytest.raises(grammar.GrammarError, match=words):
        grammar.grammar_for(Constraint(kind, source), vocab)


def test_lark_and_gbnf_grammars(vocab, tokenizer):
    for source in ('start: "a" | "b" digit\ndigit: /[0-9]/', 'root ::= "a" | "b" [0-9]'):
        check = grammar.check_text(Constraint("grammar", source), tokenizer("b7", add_special_tokens=False).input_ids,
                                   vocab)
        assert check.first_bad is None and check.is_complete


def test_check_text_finds_where_the_text_leaves(vocab, tokenizer):
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    good = tokenizer('{"a": 12}', add_special_tokens=False).input_ids
    check = grammar.check_text(Constraint("json_schema", schema), good, vocab)
    assert check.first_bad is None and check.is_complete
    assert check.masks.shape == (len(good), vocab.vocab_size)
    assert all(check.masks[i, t] for i, t in enumerate(good))
    prefix = grammar.check_text(Constraint("json_schema", schema), good[:-1], vocab)
    assert prefix.first_bad is None and not prefix.is_complete
    bad = tokenizer('{"a": "x"}', add_special_tokens=False).input_ids
    check = grammar.check_text(Constraint("json_schema", schema), bad, vocab)
    quote = next(i for i, t in enumerate(bad) if i > 2 and '"' in tokenizer.decode([t]))
    assert check.first_bad == quote and not check.masks[quote, bad[quote]]


def test_every_stop_token_ends_a_complete_text(table, tokenizer):
    """A model with several stop tokens: each is allowed exactly where the text is complete."""
    vocab = grammar.vocab_for(TokenTable.build(tokenizer, len(tokenizer)), [STOP, 0], tokenizer)
    state = grammar.new_state(Constraint("regex", "[0-9]+"), vocab)
    assert not state.allowed()[[STOP, 0]].any()
    state.advance(tokenizer("7", add_special_tokens=False).input_ids[0])
    assert state.allowed()[[STOP, 0]].all()
    state.advance(0)
    assert state.is_finished


def test_a_full_cache_drops_the_least_recently_used_and_its_states_still_work(monkeypatch, vocab, table, tokenizer):
    """The cache stays at its size however many constraints come; a state made before its grammar was
    dropped keeps answering, and the dropped constraint compiles again (a miss) to the same allowed sets."""
    monkeypatch.setattr(grammar, "_cache", grammar._Cache(2))
    choices = [b"12", b"34"]
    kept = Constraint("choice", json.dumps([c.decode() for c in choices]))
    early = grammar.new_state(kept, vocab)
    for n in range(4):  # four other constraints push `kept` out
        grammar.grammar_for(Constraint("regex", f"[0-9]{{{n + 1}}}"), vocab)
    stats = grammar.cache_stats()
    assert stats["entries"] == 2 and stats["misses"] == 5
    late = grammar.new_state(kept, vocab)
    assert grammar.cache_stats()["misses"] == 6  # compiled again
    expected = expected_for_choices(table, choices, b"")
    assert np.array_equal(early.allowed()[:len(expected)], expected)
    assert np.array_equal(late.allowed()[:len(expected)], expected)
    one = tokenizer("1", add_special_tokens=False).input_ids[0]
    early.advance(one)
    late.advance(one)
    after_one = expected_for_choices(table, choices, b"1")
    assert np.array_equal(early.allowed()[:len(after_one)], after_one)
    assert np.array_equal(late.allowed()[:len(after_one)], after_one)
