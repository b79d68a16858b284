"""The prompt's forms and the fields every route that takes a prompt shares (completions, /v1/score,
/v1/compare, /v1/tree, /tokenize), with their checks."""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import Field

from ..errors import InvalidRequest
from . import validation as v
from .schema import DEFAULT_LIMITS as _L
from .schema import Cap

Prompt = Union[str, list[str], list[int], list[list[int]]]
PROMPT_TYPE = "a string, an array of strings, an array of integers or an array of arrays of integers"
TopLogprobs = Annotated[int | None, Field(None, ge=0, le=_L.max_logprobs), Cap("max_logprobs")]


def all_ints(values) -> bool:
    return all(isinstance(x, int) and not isinstance(x, bool) for x in values)


def prompt_list(value, name: str = "prompt") -> list:
    """A prompt field as a list of strings or a list of token-id lists."""
    if value is None:
        raise InvalidRequest(f"Missing required parameter: '{name}'.", name)
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        if isinstance(value, list):
            raise v.value_error(name, f"a non-empty {name}")
        raise v.type_error(name, PROMPT_TYPE, nullable=False)
    if all(isinstance(x, str) for x in value):
        return value
    if all_ints(value):
        return [value]
    if all(isinstance(x, list) and x and all_ints(x) for x in value):
        return value
    raise v.type_error(name, PROMPT_TYPE, nullable=False)
