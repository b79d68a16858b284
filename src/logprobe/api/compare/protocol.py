"""The body of /v1/compare: two or more served models on one text or the same tokens."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from ...config import Limits
from ..checks import validation as v
from ..checks.prompts import all_ints
from ..checks.sampling import TokensAsIds, User
from ..checks.schema import RequestModel, check, parses
from ..errors import InvalidRequest


class CompareBody(RequestModel):
    """POST /v1/compare."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"models": ["base", "tuned"], "input": "The cat sat on the mat."},
        {"models": ["base", "tuned"], "context": "Question: 2 + 2 = ?\nAnswer:", "input": " 4"},
        {"models": ["base", "tuned"], "input": "Naïve fans of 日本語", "align": "text"},
    ]})

    models: list[str] = Field(..., min_length=2, description="Two different served models (names or aliases) "
                              "that share a tokenizer: p is the first, q the second. With align 'text': two "
                              "or more of any tokenizers, each once.")
    input: str | list[int] = Field(..., description="The text or token ids compared (cap: the models' "
                                   "limits.vocab_positions tokens, context included; with align 'text', a "
                                   "text within each model's context).")
    context: str | None = Field(None, description="Conditioned on but not compared; tokenized apart from the "
                                "input and put in front.")
    stream: Literal[False] | None = Field(None, description="Not offered: false or null.")
    user: User
    # ---- logprobe extensions ----
    add_special_tokens: bool | None = Field(True, description="Let the tokenizer add its special tokens (BOS) "
                                            "in front of the text.")
    return_tokens_as_token_ids: TokensAsIds
    align: Literal["tokens", "text"] | None = Field("tokens", description="'tokens': two models of one "
                                                    "tokenizer, divergences per token; 'text': two or more "
                                                    "models of any tokenizers, log probabilities per span of "
                                                    "the text where every tokenization has a boundary.")

    @classmethod
    def check_known_fields(cls, body: dict) -> None:
        if "model" in body and "models" not in body:
            raise InvalidRequest("/v1/compare takes 'models', the two models to compare (an array of two names), "
                                 "not 'model'.", "model")
        super().check_known_fields(body)

    @parses("models")
    def parse_models(value, limits: Limits) -> list[str]:
        if value is None:
            raise InvalidRequest("Missing required parameter: 'models'.", "models")
        if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
            raise v.type_error("models", "an array of two model names", nullable=False)
        if len(value) < 2:
            raise InvalidRequest(f"Invalid value for 'models': expected two model names (two or more with "
                                 f"'align': 'text'), got {len(value)}.", "models")
        return list(value)

    @parses("input")
    def parse_input(value, limits: Limits) -> str | list[int]:
        if value is None:
            raise InvalidRequest("Missing required parameter: 'input'.", "input")
        if isinstance(value, list) and value and all_ints(value):
            return list(value)
        if not isinstance(value, str):
            if isinstance(value, list) and not value:
                raise v.value_error("input", "a non-empty input")
            raise v.type_error("input", "a string or an array of token ids", nullable=False)
        return value

    @parses("stream")
    def parse_stream(value, limits: Limits) -> bool:
        if v.get_bool({"stream": value}, "stream", False):
            raise InvalidRequest("/v1/compare does not stream: send the request without 'stream': true.", "stream")
        return False

    @check
    def check_align(self, limits: Limits) -> None:
        if self.align == "tokens" and len(self.models) != 2:
            raise InvalidRequest(f"Invalid value for 'models': expected two model names, got {len(self.models)}; "
                                 "to compare more than two, send 'align': 'text'.", "models")
        if self.align == "text" and not isinstance(self.input, str):
            raise InvalidRequest("Invalid value for 'input': with 'align': 'text' the input is a text; token ids "
                                 "belong to one tokenizer.", "input")
