"""Steering fields that need the model: `logit_bias` and `allowed_token_ids` checked against its
vocabulary, and `bad_words` tokenized with its tokenizer, before anything is held (docs/api.md,
section 2.5). The engine applies them (engine/device/steering.py)."""

from __future__ import annotations

from dataclasses import replace

from ...backend import SamplingParams
from ..errors import InvalidRequest
from .vocabulary import check_token_ids


def bad_words_ids(tokenizer, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Each word's token ids as vLLM reads `bad_words`: the word without its leading spaces, and the
    same word after one space when that spells it with another first token in as many tokens (a word
    inside a sentence; a tokenizer that adds its own space marker gives the same tokens plus one, which
    is left out). Repeats are kept once."""
    out: dict[tuple[int, ...], None] = {}
    for word in words:
        bare = tuple(tokenizer(word.lstrip(), add_special_tokens=False).input_ids)
        spaced = tuple(tokenizer(" " + word.lstrip(), add_special_tokens=False).input_ids)
        if bare:
            out[bare] = None
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            out[spaced] = None
    return tuple(out)


def check_steering(backend, params: SamplingParams) -> None:
    """Token ids of `logit_bias` and `allowed_token_ids` inside the model's vocabulary, and at least one
    allowed token that no bad word of one token bans."""
    vocab = backend.info.vocab_size
    check_token_ids([t for t, _ in params.logit_bias], vocab, "logit_bias")
    check_token_ids(params.allowed_token_ids or (), vocab, "allowed_token_ids")
    if params.allowed_token_ids is not None and params.bad_words_ids:
        banned = {w[0] for w in params.bad_words_ids if len(w) == 1}
        if set(params.allowed_token_ids) <= banned:
            raise InvalidRequest("Invalid value for 'bad_words': it bans every token of 'allowed_token_ids', so "
                                 "no token could be generated.", "bad_words")


def with_bad_words(backend, params: SamplingParams, words: tuple[str, ...]) -> SamplingParams:
    """`params` with the bad words' token ids (the model's tokenizer)."""
    if not words:
        return params
    return replace(params, bad_words_ids=bad_words_ids(backend.tokenizer, words))
