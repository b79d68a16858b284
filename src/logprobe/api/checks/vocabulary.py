"""The one check of token ids a request sends (prompts, inputs, `logit_bias`, `allowed_token_ids`,
`logprob_token_ids`, a patch's source, `/detokenize`): each must be a token of the model's vocabulary.
The message gives the vocabulary's size, as vLLM's does."""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import InvalidRequest


def check_token_ids(ids: Iterable[int], vocab_size: int, param: str) -> None:
    """400 naming `param` at the first id outside 0..vocab_size-1."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"Invalid value for '{param}': token id {bad} is outside the vocabulary of "
                             f"{vocab_size} tokens (ids 0 to {vocab_size - 1}).", param)
