"""The bodies of the routes that read a given text without generating: /v1/score and /v1/compare."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from ...config import Limits
from .. import validation as v
from ..errors import InvalidRequest
from .base import RequestModel, check, parses
from . import score_fields
from .completions import ChatBody, Message, Prompt, TopLogprobs, all_ints, message_list, prompt_list
from .constraints import ConstraintFields, ResponseFormatField, StructuredOutputsField
from .sampling import ResidualStream, SamplingFields, TokensAsIds, User


class ScoreBody(ConstraintFields):
    """POST /v1/score."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "smollm2-135m", "input": "a stitch in time saves nine", "top_logprobs": 2},
        {"model": "smollm2-135m", "context": "Question: 2 + 2 = ?\nAnswer:", "input": [" 4", " 5"]},
        {"model": "smollm2-135m", "messages": [{"role": "user", "content": "What is 2 + 2?"}],
         "replies": ["4", "5"]},
    ]})

    model: str = Field(..., description="The model's name or one of its aliases.")
    input: Prompt | None = Field(None, description="The text(s) or token ids to score (cap: --max-prompts); "
                                 "required unless `messages` is sent.")
    context: str | list[str] | None = Field(None, description="Conditioned on but not scored: one for every "
                                            "input, or one per input.")
    user: User
    # ---- logprobe extensions ----
    add_bos: bool | None = Field(True, description="Put the model's BOS (or EOS) in front, so the first token "
                                 "is scored.")
    top_logprobs: TopLogprobs = Field(description="The k likeliest at each position.")
    output_residual_stream: ResidualStream = Field(description="Activations at these layers.")
    return_tokens_as_token_ids: TokensAsIds
    position_stats: bool | None = Field(False, description="The entropy (nats) of the distribution that "
                                        "predicts each input token, in each entry's `position_stats`.")
    response_format: ResponseFormatField = Field(description="Score under this constraint (as for chat); not "
                                                 "with structured_outputs.")
    structured_outputs: StructuredOutputsField = Field(description="Score under this constraint (as for "
                                                       "completions).")
    messages: list[Message] | None = Field(None, description="A conversation, rendered by the model's chat "
                                           "template as /v1/chat/completions renders it, instead of `input`: "
                                           "its assistant turns are scored.")
    conversations: list[list[Message]] | None = Field(None, description="Several conversations, each scored on "
                                                      "its last assistant turn (one entry each, in order), instead of "
                                                      "`messages` or `input`: what a dataset of conversations sends.")
    score_messages: list[int] | None = Field(None, description="The indices of the assistant messages scored, "
                                             "one entry each (default: the last assistant message).")
    replies: list[str] | None = Field(None, description="Candidate contents of the assistant turn after "
                                      "`messages`, one entry each; they share the conversation's pass.")
    include_end_of_turn: bool | None = Field(True, description="With `messages`: score the template's "
                                             "end-of-turn token after each scored reply too.")
    logprob_token_ids: list[int] | list[list[int]] | list[list[list[int]]] | None = Field(
        None, description="These ids' log probabilities and ranks at every scored position, or one list of ids "
        "per scored position (per entry: [[[...]]]); caps: max_logprob_token_ids at a position, "
        "max_position_token_ids in all.")

    parse_residual = staticmethod(SamplingFields.parse_residual)

    @parses("input")
    def parse_input(value, limits: Limits) -> list | None:
        return None if value is None else prompt_list(value, "input")

    @parses("messages")
    def parse_messages(value, limits: Limits) -> list[dict] | None:
        return None if value is None else ChatBody.parsers()["messages"](value, limits)

    @parses("conversations")
    def parse_conversations(value, limits: Limits) -> list[list[dict]] | None:
        if value is None:
            return None
        if not isinstance(value, list) or not value:
            raise InvalidRequest("Invalid value for 'conversations': expected a non-empty array of conversations "
                                 "(each an array of messages).", "conversations")
        if len(value) > limits.max_prompts:
            raise InvalidRequest(f"Too many conversations: this server takes at most {limits.max_prompts} in one "
                                 f"request (max_prompts), and this one has {len(value)}.", "conversations")
        return [message_list(c, f"conversations[{i}]", "conversations") for i, c in enumerate(value)]

    parse_score_messages = parses("score_messages")(score_fields.parse_indices)
    parse_replies = parses("replies")(score_fields.parse_replies)
    parse_logprob_token_ids = parses("logprob_token_ids")(score_fields.parse_asked_ids)

    @parses("context")
    def parse_context(value, limits: Limits) -> list[str] | str | None:
        if value is None or isinstance(value, str) or (isinstance(value, list)
                                                       and all(isinstance(c, str) for c in value)):
            return value
        raise v.type_error("context", "a string or an array of strings")

    @check
    def check_conversation(self, limits: Limits) -> None:
        score_fields.check_conversation(self, limits)
        score_fields.check_entry_lists(self, len(self.conversations) if self.conversations is not None
                                       else len(self.input) if self.messages is None
                                       else len(score_fields.scored_turns(self)))

    @check
    def check_contexts(self, limits: Limits) -> None:
        if self.messages is not None or self.conversations is not None:
            return
        if isinstance(self.context, list) and len(self.context) != len(self.input):
            raise InvalidRequest(f"Invalid value for 'context': {len(self.context)} contexts for {len(self.input)} "
                                 "inputs; send one context, or one per input.", "context")
        if len(self.input) > limits.max_prompts:
            raise InvalidRequest(f"Too many inputs: this server takes at most {limits.max_prompts} inputs in one "
                                 f"request (max_prompts), and this one has {len(self.input)}.", "input")

    @property
    def contexts(self) -> list[str | None]:
        """One context per input."""
        if isinstance(self.context, list):
            return list(self.context)
        return [self.context] * len(self.input or [])


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
