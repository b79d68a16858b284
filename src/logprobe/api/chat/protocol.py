"""The body of /v1/chat/completions: OpenAI's fields in OpenAI's order, then logprobe's and vLLM's
extensions in a marked block (the conversation's messages are checks/messages.py's, which /v1/score,
/v1/tree and /tokenize share). The model is both the route's checks (with the contract's messages) and
its OpenAPI body schema."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from ...config import Limits
from ..checks.constraints import ConstraintFields, ResponseFormatField, StructuredOutputsField
from ..checks.sampling import (
    AllowedTokenIds,
    BadWords,
    IgnoreEos,
    Interventions,
    Lens,
    LogitBias,
    LogprobsMode,
    LogprobTokenIds,
    MinTokens,
    N,
    PositionStats,
    PromptLogprobs,
    ResidualStream,
    ReturnUnmodified,
    SamplingFields,
    Seed,
    SkipSpecialTokens,
    Stop,
    Stream,
    StreamOptionsField,
    Temperature,
    TokensAsIds,
    TopK,
    TopLogprobsP,
    TopP,
    User,
    VocabEncoding,
)
from ..checks.messages import Message, message_list
from ..checks.prompts import TopLogprobs
from ..checks.schema import Neutral, Unbounded, check, parses
from ..errors import InvalidRequest

class ChatBody(SamplingFields, ConstraintFields):
    """POST /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
         "logprobs": True, "top_logprobs": 2},
    ]})

    model: str = Field(..., description="The model's name or one of its aliases.")
    messages: list[Message] = Field(..., min_length=1, description="Rendered with the model's chat template.")
    frequency_penalty: Annotated[Literal[0] | None, Neutral(None, 0)] = Field(
        None, description="Not implemented: accepted as 0 or null.")
    logit_bias: LogitBias
    logprobs: bool | None = Field(False, description="Log probabilities of the reply's tokens.")
    top_logprobs: TopLogprobs = Field(description="The k likeliest at each position (needs logprobs: true).")
    max_tokens: Annotated[int | None, Unbounded()] = Field(
        None, ge=0, description="The older name of max_completion_tokens.")
    max_completion_tokens: Annotated[int | None, Unbounded()] = Field(
        None, ge=0, description="Tokens to generate; default: the rest of the context.")
    n: N
    presence_penalty: Annotated[Literal[0] | None, Neutral(None, 0)] = Field(
        None, description="Not implemented: accepted as 0 or null.")
    response_format: ResponseFormatField
    seed: Seed
    service_tier: Annotated[Literal["auto"] | None, Neutral(None, "auto")] = Field(
        None, description="Not implemented: \"auto\" or null.")
    stop: Stop
    store: Annotated[Literal[False] | None, Neutral(None, False)] = Field(
        None, description="Not implemented: false or null.")
    stream: Stream
    stream_options: StreamOptionsField
    temperature: Temperature
    top_p: TopP
    tools: Annotated[list[dict] | None, Neutral(None, [])] = Field(
        None, max_length=0, description="Not implemented: [] or null.")
    tool_choice: Annotated[Literal["none"] | None, Neutral(None, "none")] = Field(
        None, description="Not implemented: \"none\" or null.")
    parallel_tool_calls: Annotated[Literal[False] | None, Neutral(None, False)] = Field(
        None, description="Not implemented: false or null.")
    user: User
    metadata: Annotated[dict | None, Neutral(None, {})] = Field(
        None, max_length=0, description="Not implemented: {} or null.")
    # ---- logprobe / vLLM extensions ----
    top_k: TopK
    prompt_logprobs: PromptLogprobs
    vocab_encoding: VocabEncoding
    return_tokens_as_token_ids: TokensAsIds
    output_residual_stream: ResidualStream
    output_lens: Lens
    logprob_token_ids: LogprobTokenIds
    position_stats: PositionStats
    top_logprobs_p: TopLogprobsP
    logprobs_mode: LogprobsMode
    interventions: Interventions
    return_unmodified: ReturnUnmodified
    allowed_token_ids: AllowedTokenIds
    bad_words: BadWords
    min_tokens: MinTokens
    ignore_eos: IgnoreEos
    skip_special_tokens: SkipSpecialTokens
    structured_outputs: StructuredOutputsField

    @parses("messages")
    def parse_messages(value, limits: Limits) -> list[dict]:
        """Each message as {"role", "content"}, text parts joined."""
        return message_list(value)

    @property
    def max_tokens_given(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    @check
    def check_top_logprobs(self, limits: Limits) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("Invalid value for 'top_logprobs': 'logprobs' must be true when 'top_logprobs' "
                                 "is set.", "top_logprobs")
