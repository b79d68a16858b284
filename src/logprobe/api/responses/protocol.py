"""The body of POST /v1/responses (OpenAI's Responses API): its fields in the order of OpenAI's reference,
then logprobe's extensions in a marked block. What maps onto the chat pipeline is checked into a
conversation (`input`, `instructions`), sampling settings and a constraint (`text.format`); what cannot
apply here (tools, stored responses, background mode) is refused by name.

`store` is accepted and ignored, as vLLM does by default: nothing is stored (OpenAI's default is
`store: true`, which clients send without meaning to keep anything), and the response says
`"store": false`. `previous_response_id` is therefore refused: there is no stored response to follow.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Field

from ...backend import Constraint
from ...config import Limits
from ..checks import validation as v
from ..checks.constraints import format_kind, json_schema_constraint
from ..checks.sampling import Seed, Temperature, TopK, TopP, User, checked_object, inside
from ..checks.schema import Neutral, RequestModel, Unbounded, check, parses
from ..errors import InvalidRequest

LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text")  # an earlier reply passed back holds output_text parts
MESSAGE_KEYS = frozenset(("type", "role", "content", "id", "status"))
PART_KEYS = frozenset(("type", "text", "annotations", "logprobs"))
FORMAT_KEYS = frozenset(("type", "name", "schema", "description", "strict"))


class InputText(RequestModel):
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(RequestModel):
    type: Literal["message"] | None = Field(None, description="Only message items are taken.")
    role: Literal["user", "assistant", "system", "developer"] = Field(..., description="developer is read as "
                                                                    "system by the chat template.")
    content: Union[str, list[InputText]]
    id: str | None = Field(None, description="An earlier output item's id: accepted, unused.")
    status: str | None = Field(None, description="Accepted, unused.")


class TextFormat(RequestModel):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = Field(None, description="json_schema: the schema's name (required, unused).")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="json_schema: a JSON Schema.")
    description: str | None = None
    strict: bool | None = Field(None, description="Accepted; the schema is enforced either way.")


class TextConfig(RequestModel):
    format: TextFormat | None = Field(None, description=(
        "{\"type\": \"text\"} (no constraint), {\"type\": \"json_object\"} or {\"type\": \"json_schema\", \"name\", "
        "\"schema\"}."))
    verbosity: Annotated[Literal["medium"] | None, Neutral(None, "medium")] = None


class ResponsesStreamOptions(RequestModel):
    include_obfuscation: bool | None = Field(None, description="Accepted; logprobe's events carry no padding.")


class ResponsesBody(RequestModel):
    """POST /v1/responses."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "smollm2-135m", "input": "Say hi.", "max_output_tokens": 4, "temperature": 0,
         "include": [LOGPROBS_INCLUDE], "top_logprobs": 2},
    ]})

    model: str = Field(..., description="The model's name or one of its aliases.")
    input: Union[str, list[InputMessage]] = Field(..., description="A text (one user message) or message items, "
                                                  "rendered with the model's chat template.")
    background: Annotated[Literal[False] | None, Neutral(None, False)] = Field(
        None, description="Not implemented: false or null.")
    include: list[Literal["message.output_text.logprobs"]] | None = Field(
        None, description="Only \"message.output_text.logprobs\": each output token's log probability.")
    instructions: str | None = Field(None, description="A system message in front of the input.")
    max_output_tokens: Annotated[int | None, Unbounded()] = Field(
        None, ge=1, description="Tokens to generate; default: the rest of the context.")
    max_tool_calls: Annotated[int | None, Neutral(None)] = Field(None, description="Not implemented: null.")
    metadata: Annotated[dict | None, Neutral(None, {})] = Field(
        None, max_length=0, description="Not implemented: {} or null.")
    parallel_tool_calls: bool | None = Field(None, description="Accepted, unused (no tools).")
    previous_response_id: str | None = Field(None, description="Refused: responses are not stored.")
    prompt: Annotated[dict | None, Neutral(None)] = Field(None, description="Not implemented: null.")
    prompt_cache_key: str | None = Field(None, description="Accepted, unused (the prefix cache needs no key).")
    reasoning: Annotated[dict | None, Neutral(None, {})] = Field(
        None, max_length=0, description="Not implemented: {} or null.")
    safety_identifier: str | None = Field(None, description="Recorded, unused.")
    service_tier: Annotated[Literal["auto", "default"] | None, Neutral(None, "default", "auto")] = Field(
        None, description="Not implemented: \"auto\", \"default\" or null.")
    store: bool | None = Field(None, description="Accepted and ignored: nothing is stored (vLLM's default).")
    stream: bool | None = Field(False, description="Server-sent events: OpenAI's Responses events.")
    stream_options: ResponsesStreamOptions | None = Field(None, description="Only with stream: true.")
    temperature: Temperature
    text: TextConfig | None = Field(None, description="text.format: structured output.")
    tool_choice: Annotated[Literal["auto", "none"] | None, Neutral(None, "none", "auto")] = Field(
        None, description="Not implemented: \"auto\", \"none\" or null.")
    tools: Annotated[list[dict] | None, Neutral(None, [])] = Field(
        None, max_length=0, description="Not implemented: [] or null.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        "The k likeliest tokens at each output position (needs include message.output_text.logprobs)."))
    top_p: TopP
    truncation: Annotated[Literal["disabled"] | None, Neutral(None, "disabled")] = Field(
        None, description="Not implemented: \"disabled\" or null.")
    user: User
    # ---- logprobe / vLLM extensions ----
    top_k: TopK
    seed: Seed

    @parses("input")
    def parse_input(value, limits: Limits) -> list[dict]:
        """The conversation as the chat template's messages ({"role", "content"}, text parts joined)."""
        if isinstance(value, str):
            return [{"role": "user", "content": value}]
        if isinstance(value, list) and value:
            return [_message(item, f"input[{i}]") for i, item in enumerate(value)]
        if value is None:
            raise InvalidRequest("Missing required parameter: 'input'.", "input")
        raise InvalidRequest("Invalid value for 'input': expected a string or a non-empty array of message items.",
                             "input")

    @parses("include")
    def parse_include(value, limits: Limits) -> bool:
        """Whether output log probabilities are asked: the one include value that applies here."""
        if value is None:
            return False
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise v.type_error("include", "an array of strings")
        for item in value:
            if item != LOGPROBS_INCLUDE:
                raise InvalidRequest(f"Invalid value for 'include': {item[:80]!r} is not available here; logprobe "
                                     f"produces only message text, and takes only '{LOGPROBS_INCLUDE}'.", "include")
        return bool(value)

    @parses("previous_response_id")
    def parse_previous_response_id(value, limits: Limits) -> None:
        if value is not None:
            raise InvalidRequest("Unsupported request argument supplied: previous_response_id (logprobe does not "
                                 "store responses, so there is none to continue; send the whole conversation in "
                                 "'input' instead).", "previous_response_id")

    @parses("stream_options")
    def parse_stream_options(value, limits: Limits) -> dict | None:
        value = checked_object("stream_options", value, ResponsesStreamOptions)
        if value is not None:
            with inside("stream_options"):
                v.get_bool(value, "include_obfuscation", False)
        return value

    @parses("text")
    def parse_text(value, limits: Limits) -> Constraint | None:
        """`text.format` as a Constraint (None for type text); `text.verbosity` only at its default."""
        value = checked_object("text", value, TextConfig)
        return None if value is None else _text_format(value.get("format"))

    @check
    def check_top_logprobs(self, limits: Limits) -> None:
        if self.top_logprobs and not self.include:
            raise InvalidRequest(f"Invalid value for 'top_logprobs': log probabilities are returned only with "
                                 f"'include': ['{LOGPROBS_INCLUDE}'].", "top_logprobs")
        if self.top_logprobs is not None and self.top_logprobs > limits.max_logprobs:
            raise v.value_error("top_logprobs", f"a value less than or equal to {limits.max_logprobs}")

    @check
    def check_stream_options(self, limits: Limits) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("'stream_options' is only allowed with 'stream': true.", "stream_options")


def _message(item, where: str) -> dict:
    if not isinstance(item, dict):
        raise InvalidRequest(f"Invalid type for '{where}': expected an object.", "input")
    kind = item.get("type", "message")
    if kind != "message":
        raise InvalidRequest(f"Invalid value for '{where}.type': logprobe takes message items only, not "
                             f"{str(kind)[:40]!r} (no tools, no reasoning items, no item references).", "input")
    for key in item:
        if key not in MESSAGE_KEYS:
            raise InvalidRequest(f"Unrecognized request argument supplied: {where}.{key}", "input")
    role, content = item.get("role"), item.get("content")
    if role not in ROLES:
        raise InvalidRequest(f"Invalid value for '{where}.role': expected one of {', '.join(ROLES)}.", "input")
    if isinstance(content, list):
        content = "".join(_text_part(part, f"{where}.content[{j}]") for j, part in enumerate(content))
    if not isinstance(content, str):
        raise InvalidRequest(f"Invalid type for '{where}.content': expected a string or an array of text "
                             "parts.", "input")
    return {"role": ROLES[role], "content": content}


def _text_part(part, where: str) -> str:
    if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
        kind = part.get("type") if isinstance(part, dict) else None
        raise InvalidRequest(f"Invalid value for '{where}.type': only text parts ({', '.join(TEXT_PARTS)}) are "
                             f"supported{f', not {str(kind)[:40]!r}' if kind else ''}.", "input")
    for key in part:
        if key not in PART_KEYS:
            raise InvalidRequest(f"Unrecognized request argument supplied: {where}.{key}", "input")
    if not isinstance(part.get("text"), str):
        raise InvalidRequest(f"Invalid type for '{where}.text': expected a string.", "input")
    return part["text"]


def _text_format(spec) -> Constraint | None:
    """OpenAI's `text.format` -> a Constraint, as response_format is for chat (checks/constraints.py)."""
    name = "text.format"
    if spec is None:
        return None
    kind = format_kind(spec, name, FORMAT_KEYS)
    if kind == "json_schema":
        return json_schema_constraint(spec, name)
    extra = next((key for key in ("name", "schema", "description", "strict") if spec.get(key) is not None), None)
    if extra:
        raise InvalidRequest(f"'{name}.{extra}' is only used with 'type': 'json_schema'.", f"{name}.{extra}")
    return None if kind == "text" else Constraint("json_object", "")
