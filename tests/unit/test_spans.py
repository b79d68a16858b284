"""output/spans.py on hand-made tokenizations: the coarsest common segmentation, multi-byte characters
split by byte-level tokens, tokens that cross the other tokenization's boundaries, empty tokens, and
texts a tokenization does not spell."""

from __future__ import annotations

import numpy as np
import pytest

from logprobe.output.spans import Misspelled, align


def cut(text: str, *pieces: str) -> list[bytes]:
    assert "".join(pieces) == text
    return [p.encode() for p in pieces]


def span_texts(text: str, al) -> list[str]:
    edges = al.char_bounds.tolist()
    return [text[a:b] for a, b in zip(edges[:-1], edges[1:])]


def test_words_where_both_cut():
    text = "the cat sat"
    a = cut(text, "the", " cat", " sat")
    b = cut(text, "th", "e", " c", "at", " s", "a", "t")
    al = align(text, [a, b])
    assert span_texts(text, al) == ["the", " cat", " sat"]
    assert al.token_spans[0].tolist() == [0, 1, 2]
    assert al.token_spans[1].tolist() == [0, 0, 1, 1, 2, 2, 2]
    assert al.token_bytes[1].tolist() == [0, 2, 3, 5, 7, 9, 10]
    assert al.span_counts(1).tolist() == [2, 2, 3]
    np.testing.assert_array_equal(al.span_sums(1, [1, 2, 3, 4, 5, 6, 7]), [3, 7, 18])


def test_tokens_that_cross_each_others_boundaries_merge_spans():
    """a: "ab|cd|ef", b: "a|bc|de|f": the only common cuts are the ends."""
    text = "abcdef"
    al = align(text, [cut(text, "ab", "cd", "ef"), cut(text, "a", "bc", "de", "f")])
    assert span_texts(text, al) == ["abcdef"]
    assert al.token_spans[0].tolist() == [0, 0, 0] and al.token_spans[1].tolist() == [0, 0, 0, 0]
    al = align(text, [cut(text, "ab", "cd", "ef"), cut(text, "a", "bc", "d", "ef")])
    assert span_texts(text, al) == ["abcd", "ef"]


def test_a_character_split_by_both_is_not_cut():
    """é is two bytes, 日 three. Both tokenizations cut inside 日 at the same byte: no span ends there."""
    text = "é日x"
    data = text.encode()
    a = [data[:1], data[1:2], data[2:4], data[4:5], data[5:]]  # é split, 日 cut after its second byte
    b = [data[:2], data[2:4], data[4:]]  # 日 cut after its second byte too
    al = align(text, [a, b])
    assert al.bounds.tolist() == [0, 2, 6]
    assert span_texts(text, al) == ["é", "日x"]
    assert al.char_bounds.tolist() == [0, 1, 3]
    assert al.token_spans[0].tolist() == [0, 0, 1, 1, 1]
    assert al.token_spans[1].tolist() == [0, 1, 1]


def test_three_tokenizations():
    text = "one two three"
    al = align(text, [cut(text, "one", " two", " three"), cut(text, "on", "e two", " three"),
                      cut(text, "one", " t", "wo th", "ree")])
    assert span_texts(text, al) == ["one two three"]
    al = align(text, [cut(text, "one", " two", " three"), cut(text, "on", "e", " two", " three"),
                      cut(text, "one", " t", "wo", " three")])
    assert span_texts(text, al) == ["one", " two", " three"]


def test_empty_tokens_and_special_tokens_as_their_text():
    text = "<s>hi"
    al = align(text, [[b"", b"<s>", b"hi", b""], [b"<", b"s>h", b"i"]])
    assert span_texts(text, al) == ["<s>hi"]
    assert al.token_spans[0].tolist() == [0, 0, 0, 0]
    al = align(text, [[b"<s>", b"", b"hi"], [b"<s>", b"h", b"i"]])
    assert span_texts(text, al) == ["<s>", "hi"]
    assert al.token_spans[0].tolist() == [0, 1, 1]  # an empty token at a cut goes with what follows


def test_minus_infinity_stays_in_its_span():
    text = "ab"
    al = align(text, [cut(text, "a", "b")])
    sums = al.span_sums(0, np.array([-np.inf, -1.0], dtype=np.float32))
    assert np.isneginf(sums[0]) and sums[1] == -1.0


@pytest.mark.parametrize("pieces,which,at", [
    ([[b"ab"], [b"a", b"c"]], 1, 1),
    ([[b"ab"], [b"a"]], 1, 1),
    ([[b"abc"], [b"ab"]], 0, 2),
])
def test_a_tokenization_that_does_not_spell_the_text(pieces, which, at):
    with pytest.raises(Misspelled) as info:
        align("ab", pieces)
    assert (info.value.which, info.value.at) == (which, at)
