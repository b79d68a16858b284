"""The bodies of /tokenize and /detokenize."""

from __future__ import annotations

from pydantic import ConfigDict, Field

from ...config import Limits
from ..checks import validation as v
from ..checks.messages import Message, message_list
from ..checks.prompts import all_ints
from ..checks.schema import RequestModel, check, parses
from ..errors import InvalidRequest


class TokenizeBody(RequestModel):
    """POST /tokenize: a text, or a conversation rendered by the model's chat template (as vLLM's)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "smollm2-135m", "prompt": "Hello world"},
        {"model": "smollm2-135m", "messages": [{"role": "user", "content": "What is 2 + 2?"}]}]})

    model: str | None = Field(None, description="The model's name or an alias (default: the served model).")
    prompt: str | None = Field(None, description="The text to tokenize (or `messages`, not both).")
    messages: list[Message] | None = Field(None, min_length=1, description="A conversation (as /v1/chat/completions "
                                           "takes it), rendered by the model's chat template and tokenized as chat "
                                           "tokenizes it; the answer has the rendered text too (or `prompt`).")
    add_special_tokens: bool | None = Field(None, description="Let the tokenizer add its special tokens (default: "
                                            "true for `prompt`; false for `messages`, whose template writes them).")
    add_generation_prompt: bool | None = Field(None, description="With `messages`: end the rendering with the "
                                               "assistant's turn opening, as chat sends it (default true).")

    @parses("messages")
    def parse_messages(value, limits: Limits) -> list[dict] | None:
        return None if value is None else message_list(value)

    @check
    def check_one_input(self, limits: Limits) -> None:
        if self.prompt is None and self.messages is None:
            raise InvalidRequest("Missing required parameter: 'prompt' (or 'messages').", "prompt")
        if self.prompt is not None and self.messages is not None:
            raise InvalidRequest("Send either 'prompt' or 'messages', not both.", "messages")
        if self.prompt is not None and self.add_generation_prompt is not None:
            raise InvalidRequest("Invalid value for 'add_generation_prompt': it applies to 'messages' (a chat "
                                 "template's rendering), not to 'prompt'.", "add_generation_prompt")


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
