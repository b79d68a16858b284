"""The request bodies, described for the OpenAPI schema (`/openapi.json`, `/docs`).

Validation itself stays in `validation.py` and the route modules, which answer with the contract's
exact messages; these models only describe the bodies (field types, defaults, bounds at the default
caps, examples) for client generators and API explorers. A test keeps them in step with the fields the
routes accept, checks the schema with an OpenAPI validator, and sends every example to the server.
Bounds that are server options (`--max-n`, `--max-logprobs`, ...) are given at their defaults.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from ..config import Limits

_L = Limits()
INT64 = dict(ge=-(2**63), le=2**63 - 1)

Prompt = Union[str, list[str], list[int], list[list[int]]]


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Body):
    include_usage: bool = Field(False, description="A last chunk with `usage` (and `usage: null` in the others).")
    continuous_usage_stats: bool = Field(False, description="Accepted for vLLM clients; no effect.")


class ResidualStreamOptions(Body):
    layers: list[int] = Field(..., min_length=1, description="Layer indices: 0 is the embeddings (block 0's "
                              "input), l >= 1 block l's output; negative counts from the end (-1 is the last).")
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    encoding: Literal["base64", "json"] = Field("base64", description="base64 of the little-endian array "
                                                "[positions, d_model], or nested JSON lists.")


ResidualStream = Union[list[int], ResidualStreamOptions]


class LensOptions(Body):
    layers: list[int] = Field(..., min_length=1, description="Layer indices, as for output_residual_stream.")
    top_k: int = Field(5, ge=0, le=_L.max_logprobs, description="The k likeliest tokens at each position.")


Lens = Union[list[int], LensOptions]


class PatchSource(Body):
    prompt: Union[str, list[int]] = Field(..., description="Another prompt (a text, tokenized as a prompt is, "
                                          "or token ids) whose residual stream is patched in.")
    position: int = Field(-1, description="Its position to read (negative: from its end).")
    layer: int | None = Field(None, description="Its layer to read; default: the intervention's layer.")


class InterventionItem(Body):
    layer: int = Field(..., description="Where: 0 the embeddings, l block l's output (as for "
                       "output_residual_stream); negative counts from the end.")
    op: Literal["add", "scale", "zero", "set", "patch"] = Field(..., description="x + vector, x * factor, 0, "
                                                                 "vector, or another prompt's stream.")
    positions: list[int] | None = Field(None, min_length=1, description="Token positions, prompt then "
                                        "generated; negative: from the prompt's end; null: every position.")
    vector: Union[str, list[float]] | None = Field(None, description="add, set: d_model values, as base64 of "
                                                    "little-endian float32 or an array of numbers.")
    factor: float | None = Field(None, description="scale: the factor.")
    source: PatchSource | None = Field(None, description="patch: where the vector comes from.")


class _Sampling(Body):
    """Fields completions and chat share."""

    temperature: float | None = Field(1.0, ge=0, le=2, description="0 (or below 1e-5) is greedy.")
    top_p: float | None = Field(1.0, gt=0, le=1, description="Nucleus sampling.")
    top_k: int | None = Field(-1, ge=-1, description="logprobe/vLLM extension; -1 or 0: off.")
    n: int | None = Field(1, ge=1, le=_L.max_n, description="Choices per prompt (cap: --max-n).")
    stop: str | list[str] | None = Field(None, description=f"Up to {_L.max_stop} stop strings; the text ends "
                                         "before the first one, which is not returned.")
    seed: int | None = Field(None, **INT64, description="Same seed and request: same output, whatever the "
                             "server batched it with.")
    stream: bool | None = Field(False, description="Server-sent events, one chunk per choice per step.")
    stream_options: StreamOptions | None = Field(None, description="Only with stream: true.")
    user: str | None = Field(None, description="Recorded, unused.")
    prompt_logprobs: int | None = Field(None, ge=-1, le=_L.max_logprobs, description="Log probabilities of "
                                        "the prompt's tokens with the k likeliest at each position; -1: the "
                                        "whole vocabulary (cap: --max-vocab-positions). Not with stream.")
    vocab_encoding: Literal["float32", "float16"] | None = Field(None, description="With prompt_logprobs -1: "
                                                                 "each position's vocabulary as base64 of a "
                                                                 "little-endian array.")
    output_residual_stream: ResidualStream | None = Field(None, description="Activations at these layers for "
                                                          "every prompt and generated position. Not with stream.")
    output_lens: Lens | None = Field(None, description="The logit lens: these layers read through the final "
                                     "norm and the head at every prompt and generated position (log probability "
                                     "and rank of each token, the k likeliest). Cap: --max-lens-rows. Not with "
                                     "stream.")
    return_tokens_as_token_ids: bool | None = Field(False, description="Tokens as `token_id:N`.")
    logprob_token_ids: list[int] | None = Field(None, max_length=_L.max_logprob_token_ids, description=(
        "These token ids' log probabilities and ranks at every prompt and generated position (the "
        "choice's `logprob_token_ids`); with logprobs, each generated token's top_logprobs holds the token "
        "and these ids instead of the k likeliest (vLLM). Cap: --max-logprob-token-ids. Not with stream."))
    position_stats: bool | None = Field(False, description="Entropy (nats) of every prompt and generated "
                                        "position's distribution and the actual token's rank (the choice's "
                                        "`position_stats`). Not with stream.")
    top_logprobs_p: float | None = Field(None, gt=0, le=1, description=(
        "At every position, the smallest set of likeliest tokens whose probability reaches p (at most "
        "--max-top-p-tokens, else `truncated`), in `position_stats`. Not with stream."))
    interventions: list[InterventionItem] | None = Field(None, max_length=_L.max_interventions, description=(
        "Changes to the residual stream of this request's forward passes, in order; the log probabilities "
        "returned are those under them. Cap: --max-interventions."))
    return_unmodified: bool | None = Field(False, description="With interventions: each choice's "
                                           "`unmodified` block, the same tokens' log probabilities without "
                                           "them. Not with stream.")
    logprobs_mode: Literal["raw", "processed", "both"] | None = Field("raw", description=(
        "raw: log probabilities of the model's distribution; processed: of the distribution each token "
        "was drawn from (after temperature, top-k, top-p); both: raw, plus `processed_logprobs` (not with "
        "stream)."))


class CompletionBody(_Sampling):
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
    max_tokens: int | None = Field(16, ge=0, description="Tokens to generate; 0 generates nothing (scoring "
                                   "with echo). Bounded by the context.")
    logprobs: int | None = Field(None, ge=0, le=_L.max_logprobs, description="The k likeliest tokens at each "
                                 "generated position, with the chosen token's log probability.")
    echo: bool | None = Field(False, description="The prompt in front of the text; with logprobs, its tokens' "
                              "entries in front of the generated ones.")
    add_special_tokens: bool | None = Field(True, description="Let the tokenizer add its special tokens (BOS) "
                                            "to a text prompt.")
    best_of: Literal[1] | None = Field(None, description="Not implemented: accepted as 1 or null.")
    frequency_penalty: Literal[0] | None = Field(None, description="Not implemented: accepted as 0 or null.")
    presence_penalty: Literal[0] | None = Field(None, description="Not implemented: accepted as 0 or null.")
    logit_bias: dict[str, float] | None = Field(None, max_length=0, description="Not implemented: accepted "
                                                "as {} or null.")
    suffix: Literal[""] | None = Field(None, description="Not implemented: accepted as \"\" or null.")


class TextPart(Body):
    type: Literal["text"]
    text: str


class Message(Body):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatBody(_Sampling):
    """POST /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
         "logprobs": True, "top_logprobs": 2},
    ]})

    model: str = Field(..., description="The model's name or one of its aliases.")
    messages: list[Message] = Field(..., min_length=1, description="Rendered with the model's chat template.")
    max_completion_tokens: int | None = Field(None, ge=0, description="Tokens to generate; default: the rest "
                                              "of the context.")
    max_tokens: int | None = Field(None, ge=0, description="The older name of max_completion_tokens.")
    logprobs: bool | None = Field(False, description="Log probabilities of the reply's tokens.")
    top_logprobs: int | None = Field(None, ge=0, le=_L.max_logprobs, description="The k likeliest at each "
                                     "position (needs logprobs: true).")
    frequency_penalty: Literal[0] | None = Field(None, description="Not implemented: accepted as 0 or null.")
    presence_penalty: Literal[0] | None = Field(None, description="Not implemented: accepted as 0 or null.")
    logit_bias: dict[str, float] | None = Field(None, max_length=0, description="Not implemented: {} or null.")
    tools: list[dict] | None = Field(None, max_length=0, description="Not implemented: [] or null.")
    tool_choice: Literal["none"] | None = Field(None, description="Not implemented: \"none\" or null.")
    parallel_tool_calls: Literal[False] | None = Field(None, description="Not implemented: false or null.")
    response_format: dict | None = Field(None, description="Not implemented: {\"type\": \"text\"} or null.")
    store: Literal[False] | None = Field(None, description="Not implemented: false or null.")
    metadata: dict | None = Field(None, max_length=0, description="Not implemented: {} or null.")
    service_tier: Literal["auto"] | None = Field(None, description="Not implemented: \"auto\" or null.")


class ScoreBody(Body):
    """POST /v1/score."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "smollm2-135m", "input": "a stitch in time saves nine", "top_logprobs": 2},
        {"model": "smollm2-135m", "context": "Question: 2 + 2 = ?\nAnswer:", "input": [" 4", " 5"]},
    ]})

    model: str = Field(..., description="The model's name or one of its aliases.")
    input: Prompt = Field(..., description="The text(s) or token ids to score (cap: --max-prompts).")
    context: str | list[str] | None = Field(None, description="Conditioned on but not scored: one for every "
                                            "input, or one per input.")
    add_bos: bool | None = Field(True, description="Put the model's BOS (or EOS) in front, so the first token "
                                 "is scored.")
    top_logprobs: int | None = Field(None, ge=0, le=_L.max_logprobs, description="The k likeliest at each "
                                     "position.")
    output_residual_stream: ResidualStream | None = Field(None, description="Activations at these layers.")
    return_tokens_as_token_ids: bool | None = Field(False, description="Tokens as `token_id:N`.")
    user: str | None = Field(None, description="Recorded, unused.")


class CompareBody(Body):
    """POST /v1/compare."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"models": ["base", "tuned"], "input": "The cat sat on the mat."},
        {"models": ["base", "tuned"], "context": "Question: 2 + 2 = ?\nAnswer:", "input": " 4"},
    ]})

    models: list[str] = Field(..., min_length=2, max_length=2, description="Two different served models "
                              "(names or aliases) that share a tokenizer: p is the first, q the second.")
    input: str | list[int] = Field(..., description="The text or token ids compared (cap: the models' "
                                   "limits.vocab_positions tokens, context included).")
    context: str | None = Field(None, description="Conditioned on but not compared; tokenized apart from the "
                                "input and put in front.")
    add_special_tokens: bool | None = Field(True, description="Let the tokenizer add its special tokens (BOS) "
                                            "in front of the text.")
    return_tokens_as_token_ids: bool | None = Field(False, description="Tokens as `token_id:N`.")
    stream: Literal[False] | None = Field(None, description="Not offered: false or null.")
    user: str | None = Field(None, description="Recorded, unused.")


class TokenizeBody(Body):
    """POST /tokenize."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "smollm2-135m", "prompt": "Hello world"}]})

    model: str | None = Field(None, description="The model's name or an alias (default: the served model).")
    prompt: str = Field(..., description="The text to tokenize.")
    add_special_tokens: bool | None = Field(True, description="Let the tokenizer add its special tokens.")


class DetokenizeBody(Body):
    """POST /detokenize."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "smollm2-135m", "tokens": [19556, 905]}]})

    model: str | None = Field(None, description="The model's name or an alias (default: the served model).")
    tokens: list[int] = Field(..., description="Token ids (0 to vocab_size - 1).")


BODIES: dict[str, type[Body]] = {
    "/v1/completions": CompletionBody,
    "/v1/chat/completions": ChatBody,
    "/v1/score": ScoreBody,
    "/v1/compare": CompareBody,
    "/tokenize": TokenizeBody,
    "/detokenize": DetokenizeBody,
}


def add_request_bodies(schema: dict) -> dict:
    """Put each POST route's body model into an OpenAPI document built by FastAPI (the routes read raw
    JSON, so FastAPI sees no body of its own)."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in BODIES.items():
        described = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(described.pop("$defs", {}))
        components[model.__name__] = described
        operation = schema["paths"][path]["post"]
        operation["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    return schema
