"""The bodies of /tokenize and /detokenize."""

from __future__ import annotations

from pydantic import ConfigDict, Field

from ...config import Limits
from .. import validation as v
from .base import RequestModel, parses
from .completions import all_ints


class TokenizeBody(RequestModel):
    """POST /tokenize."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "smollm2-135m", "prompt": "Hello world"}]})

    model: str | None = Field(None, description="The model's name or an alias (default: the served model).")
    prompt: str = Field(..., description="The text to tokenize.")
    add_special_tokens: bool | None = Field(True, description="Let the tokenizer add its special tokens.")


class DetokenizeBody(RequestModel):
    """POST /detokenize."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "smollm2-135m", "tokens": [19556, 905]}]})

    model: str | None = Field(None, description="The model's name or an alias (default: the served model).")
    tokens: list[int] = Field(..., description="Token ids (0 to vocab_size - 1).")

    @parses("tokens")
    def parse_tokens(value, limits: Limits) -> list[int]:
        if not isinstance(value, list) or not all_ints(value):
            raise v.type_error("tokens", "an array of integers", nullable=False)
        return value
