"""The body of /v1/completions: OpenAI's fields in OpenAI's order, then logprobe's and vLLM's extensions
in a marked block (the prompt's forms are checks/prompts.py's, which the other routes share). The model
is both the route's checks (with the contract's messages) and its OpenAPI body schema."""

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
from ..checks.prompts import Prompt, prompt_list
from ..checks.schema import DEFAULT_LIMITS as _L
from ..checks.schema import Cap, Neutral, Unbounded, check, parses
from ..errors import InvalidRequest

class CompletionBody(SamplingFields, ConstraintFields):
    """POST /v1/completions."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "smollm2-135m", "prompt": "The sky is", "max_tokens": 2, "logprobs": 5, "seed": 1},
        {"model": "smollm2-135m", "prompt": "Paris is the capital of France.", "max_tokens": 0, "echo": True,
         "logprobs": 1},
        {"model": "smollm2-135m", "prompt": [[1, 2, 3]], "max_tokens": 1, "prompt_logprobs": 3},
        {"model": "smollm2-135m", "prompt": "Answer A or B:", "max_tokens": 1, "temperature": 0,
         "logprob_token_ids": [330, 389], "position_stats": True, "top_logprobs_p": 0.9},
    ]})

    model: str = Field(..., description="The model's name or one of its aliases (GET /v1/models).")
    prompt: Prompt = Field(..., description="A text, texts, token ids, or lists of token ids (one choice "
                           "set per prompt; cap: --max-prompts).")
    best_of: Annotated[Literal[1] | None, Neutral(None, 1)] = Field(
        None, description="Not implemented: accepted as 1 or null.")
    echo: bool | None = Field(False, description="The prompt in front of the text; with logprobs, its tokens' "
                              "entries in front of the generated ones.")
    frequency_penalty: Annotated[Literal[0] | None, Neutral(None, 0)] = Field(
        None, description="Not implemented: accepted as 0 or null.")
    logit_bias: LogitBias
    logprobs: Annotated[int | None, Cap("max_logprobs")] = Field(
        None, ge=0, le=_L.max_logprobs, description="The k likeliest tokens at each generated position, with "
        "the chosen token's log probability.")
    max_tokens: Annotated[int | None, Unbounded()] = Field(
        16, ge=0, description="Tokens to generate; 0 generates nothing (scoring with echo). Bounded by the "
        "context.")
    n: N
    presence_penalty: Annotated[Literal[0] | None, Neutral(None, 0)] = Field(
        None, description="Not implemented: accepted as 0 or null.")
    seed: Seed
    stop: Stop
    stream: Stream
    stream_options: StreamOptionsField
    suffix: Annotated[Literal[""] | None, Neutral("", None)] = Field(
        None, description="Not implemented: accepted as \"\" or null.")
    temperature: Temperature
    top_p: TopP
    user: User
    # ---- logprobe / vLLM extensions ----
    top_k: TopK
    prompt_logprobs: PromptLogprobs
    vocab_encoding: VocabEncoding
    add_special_tokens: bool | None = Field(True, description="Let the tokenizer add its special tokens (BOS) "
                                            "to a text prompt.")
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
    response_format: ResponseFormatField  # an extension here: OpenAI's completions have no response_format
    structured_outputs: StructuredOutputsField

    @parses("prompt")
    def parse_prompt(value, limits: Limits) -> list:
        return prompt_list(value)

    @check
    def check_num_prompts(self, limits: Limits) -> None:
        if len(self.prompt) > limits.max_prompts:
            raise InvalidRequest(f"Too many prompts: this server takes at most {limits.max_prompts} prompts "
                                 f"in one request (max_prompts), and this one has {len(self.prompt)}.", "prompt")
