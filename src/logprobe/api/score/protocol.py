"""The body of /v1/score: the log-likelihood of texts, conversations and token ids already given."""

from __future__ import annotations

from pydantic import ConfigDict, Field

from ...config import Limits
from ..checks import validation as v
from ..checks.constraints import ConstraintFields, ResponseFormatField, StructuredOutputsField
from ..checks.messages import Message, message_list
from ..checks.prompts import Prompt, TopLogprobs, prompt_list
from ..checks.sampling import ResidualStream, SamplingFields, TokensAsIds, User
from ..checks.schema import check, parses
from ..errors import InvalidRequest
from . import fields as score_fields


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
        return None if value is None else message_list(value)

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
