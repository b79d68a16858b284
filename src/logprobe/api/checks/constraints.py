"""The constraint fields (docs/api.md, "Constrained decoding"): OpenAI's `response_format` and vLLM's
`structured_outputs`, each checked into a `Constraint` (backend/) the engine compiles with llguidance.

A schema, regex or grammar that does not compile is refused here, while the body is parsed, with the
param that holds it (`response_format.json_schema.schema`, `structured_outputs.regex`, ...): llguidance
checks it without the model's vocabulary (milliseconds for the schemas people send); the compile for
the model follows with the caps (api/checks/caps.py, `compile_constraint`), from the cache when it was seen.
vLLM's removed `guided_*` fields are refused with their replacement's name: vLLM itself now drops
them without a word, and a constraint that silently does nothing is the worst answer.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated, Any, Literal, Union

import llguidance
from pydantic import Field

from ...backend import Constraint
from ...engine.host import grammar
from ..errors import InvalidRequest
from . import validation as v
from .schema import RequestModel, check, parses

REMOVED_FIELDS = {  # vLLM's removed request fields -> what replaces them
    "guided_json": "structured_outputs.json",
    "guided_regex": "structured_outputs.regex",
    "guided_choice": "structured_outputs.choice",
    "guided_grammar": "structured_outputs.grammar",
    "guided_whitespace_pattern": "structured_outputs.whitespace_pattern",
    "guided_decoding_backend": None,  # a server option in vLLM; logprobe has one backend, llguidance
}
KIND_KEYS = ("json", "regex", "choice", "grammar", "json_object")  # structured_outputs' constraint keys
STRUCTURED_KEYS = frozenset(KIND_KEYS + ("whitespace_pattern", "disable_any_whitespace"))


# ---- the shapes, for the OpenAPI schema (the checks are the functions below) --------------------------


class JsonSchemaFormat(RequestModel):
    name: str = Field(..., description="The schema's name (OpenAI requires it; logprobe does not use it).")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="A JSON Schema.")
    strict: bool | None = Field(None, description="Accepted; the schema is enforced either way (as vLLM does).")


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, description="With type json_schema.")


class StructuredOutputs(RequestModel):
    json_: Union[dict[str, Any], str] | None = Field(None, alias="json", description="A JSON Schema (an object "
                                                     "or its JSON text).")
    regex: str | None = Field(None, description="The whole text matches this regular expression.")
    choice: list[str] | None = Field(None, min_length=1, description="The text is one of these strings: the one "
                                    "the model finds likeliest after the prompt (greedy) or one drawn in proportion "
                                    "at the temperature; each choice reports every string's log probability in "
                                    "choice_logprobs.")
    grammar: str | None = Field(None, description="A context-free grammar, in Lark (or GBNF) syntax.")
    json_object: bool | None = Field(None, description="Any JSON object.")
    whitespace_pattern: str | None = Field(None, description="With json or json_object: the regex of the "
                                           "whitespace allowed between JSON tokens.")
    disable_any_whitespace: bool | None = Field(None, description="With json or json_object: no whitespace "
                                                "between JSON tokens.")


RESPONSE_FORMAT_DOC = ("OpenAI's structured output: {\"type\": \"text\"} (no constraint), {\"type\": \"json_object\"} "
                       "or {\"type\": \"json_schema\", \"json_schema\": {\"name\", \"schema\", \"strict\"}}.")
STRUCTURED_OUTPUTS_DOC = ("logprobe/vLLM extension: exactly one of json, regex, choice, grammar (Lark), json_object; "
                          "not with response_format.")
ResponseFormatField = Annotated[ResponseFormat | None, Field(None, description=RESPONSE_FORMAT_DOC)]
StructuredOutputsField = Annotated[StructuredOutputs | None, Field(None, description=STRUCTURED_OUTPUTS_DOC)]


# ---- the checks ---------------------------------------------------------------------------------------


def _known_keys(value: dict, known: frozenset, where: str) -> None:
    for key in value:
        if key not in known:
            raise InvalidRequest(f"Unrecognized request argument supplied: {where}.{key}", f"{where}.{key}")


def refuse_removed_fields(body: dict) -> None:
    """vLLM's removed `guided_*` fields: a 400 that names what replaces them."""
    for name in body:
        if name in REMOVED_FIELDS:
            new = REMOVED_FIELDS[name]
            instead = (f"use '{new}' instead" if new else
                       "leave it out: logprobe always uses llguidance")
            raise InvalidRequest(f"'{name}' was removed from vLLM's API and is not accepted here: {instead} "
                                 "(docs/api.md, Constrained decoding).", name)


def schema_text(schema: Any, param: str, options: dict | None = None) -> str:
    """A JSON schema as compact JSON text, key order kept (llguidance writes an object's properties in
    the schema's order); `options` go into its `x-guidance` object (llguidance's JSON options)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise InvalidRequest(f"Invalid value for '{param}': expected a JSON schema, and this text is not "
                                 "valid JSON.", param) from None
    if not isinstance(schema, dict):
        raise v.type_error(param, "a JSON schema (an object)", nullable=False)
    if options:
        schema = {**schema, "x-guidance": {**(schema.get("x-guidance") or {}), **options}}
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def checked(constraint: Constraint, param: str) -> Constraint:
    """The constraint, once llguidance has compiled it without a vocabulary; else a 400 naming `param`."""
    try:
        text = grammar.grammar_text(constraint)
        error = llguidance.LLMatcher.validate_grammar(text)
    except grammar.GrammarError as exc:
        error = str(exc)
    if error:
        what = {"json_schema": "JSON schema", "regex": "regular expression", "grammar": "grammar"}.get(
            constraint.kind, "constraint")
        raise InvalidRequest(f"Invalid value for '{param}': the {what} does not compile: {error.strip()}", param)
    return constraint


def format_kind(value, name: str, known: frozenset) -> str:
    """The `type` of an OpenAI structured-output object (chat's `response_format`, the Responses API's
    `text.format`), its keys checked."""
    if not isinstance(value, dict):
        raise v.type_error(name, "an object")
    _known_keys(value, known, name)
    kind = value.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise InvalidRequest(f"Invalid value for '{name}.type': expected 'text', 'json_object' or 'json_schema'.",
                             name + ".type")
    return kind


def json_schema_constraint(spec: dict, where: str) -> Constraint:
    """OpenAI's json_schema object ({"name", "schema", "description", "strict"}, keys checked) -> a
    Constraint; `where` names it in errors."""
    if not isinstance(spec.get("name"), str):
        raise InvalidRequest(f"Missing required parameter: '{where}.name' (a string).", where + ".name")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise v.type_error(where + ".strict", "a boolean")
    schema = spec.get("schema")
    if schema is None:
        schema = {}  # OpenAI: no schema is the empty one, which any JSON value meets
    param = where + ".schema"
    return checked(Constraint("json_schema", schema_text(schema, param)), param)


def response_format_constraint(value) -> Constraint | None:
    """OpenAI's `response_format` -> a Constraint (None for type text or null)."""
    name = "response_format"
    if value is None:
        return None
    kind = format_kind(value, name, frozenset(ResponseFormat.model_fields))
    if kind != "json_schema" and value.get("json_schema") is not None:
        raise InvalidRequest(f"'{name}.json_schema' is only used with 'type': 'json_schema'.", name + ".json_schema")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", "")
    spec = value.get("json_schema")
    where = name + ".json_schema"
    if not isinstance(spec, dict):
        raise InvalidRequest(f"Missing required parameter: '{where}' (an object with 'name' and 'schema').", where)
    _known_keys(spec, frozenset(("name", "description", "schema", "strict")), where)
    return json_schema_constraint(spec, where)


def structured_outputs_constraint(value) -> Constraint | None:
    """vLLM's `structured_outputs` -> a Constraint (exactly one of its constraint keys)."""
    name = "structured_outputs"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise v.type_error(name, "an object")
    _known_keys(value, STRUCTURED_KEYS, name)
    given = [k for k in KIND_KEYS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequest(f"Invalid value for '{name}': expected exactly one of 'json', 'regex', 'choice', "
                             f"'grammar', 'json_object'; got {len(given)}.", name)
    key = given[0]
    param = f"{name}.{key}"
    options = _json_options(value, key)
    item = value[key]
    if key == "json":
        return checked(Constraint("json_schema", schema_text(item, param, options)), param)
    if key == "json_object":
        if item is not True:
            raise v.type_error(param, "a boolean")
        if options:
            return checked(Constraint("json_schema", schema_text({"type": "object"}, param, options)), param)
        return Constraint("json_object", "")
    if key == "choice":
        if not isinstance(item, list) or not item or not all(isinstance(c, str) for c in item):
            raise v.type_error(param, "a non-empty array of strings", nullable=False)
        return checked(Constraint("choice", json.dumps(item, ensure_ascii=False)), param)
    if not isinstance(item, str):
        raise v.type_error(param, "a string", nullable=False)
    return checked(Constraint("regex" if key == "regex" else "grammar", item), param)


def _json_options(value: dict, key: str) -> dict:
    """`whitespace_pattern` and `disable_any_whitespace` as llguidance's JSON options."""
    options = {}
    pattern, none = value.get("whitespace_pattern"), value.get("disable_any_whitespace")
    for name, given, kind in (("whitespace_pattern", pattern, str), ("disable_any_whitespace", none, bool)):
        if given is None:
            continue
        if not isinstance(given, kind):
            raise v.type_error(f"structured_outputs.{name}", "a string" if kind is str else "a boolean")
        if key not in ("json", "json_object"):
            raise InvalidRequest(f"'structured_outputs.{name}' is only used with 'json' or 'json_object'.",
                                 f"structured_outputs.{name}")
    if pattern is not None:
        options["whitespace_pattern"] = pattern
    if none:
        options["whitespace_flexible"] = False
    return options


def one_constraint(response_format: Constraint | None, structured_outputs: Constraint | None) -> Constraint | None:
    """The request's constraint; both fields set is refused (one grammar per request)."""
    if response_format is not None and structured_outputs is not None:
        raise InvalidRequest("A request takes one constraint: send 'response_format' or 'structured_outputs', "
                             "not both.", "structured_outputs")
    return response_format if response_format is not None else structured_outputs


def compile_constraint(backend, constraint: Constraint | None, param: str = "structured_outputs") -> None:
    """Compile the constraint for the model (cached per model and constraint), so that what the parse's
    check could not see (the model's tokens) is a 400 too, before anything is held."""
    if constraint is None:
        return
    try:
        grammar.grammar_for(constraint, grammar.vocab_of_model(backend))
    except grammar.GrammarError as exc:
        raise InvalidRequest(f"Invalid value for '{param}': the constraint does not compile for this model: "
                             f"{str(exc).strip()}", param) from None


class ConstraintFields(RequestModel):
    """The checks of `response_format` and `structured_outputs` for a body that declares them (as
    `ResponseFormatField` and `StructuredOutputsField`, in its own field order), and the refusal of
    vLLM's removed fields."""

    @classmethod
    def check_known_fields(cls, body: dict) -> None:
        refuse_removed_fields(body)
        super().check_known_fields(body)

    @parses("response_format")
    def parse_response_format(value, limits) -> Constraint | None:
        return response_format_constraint(value)

    @parses("structured_outputs")
    def parse_structured_outputs(value, limits) -> Constraint | None:
        return structured_outputs_constraint(value)

    @check
    def check_one_constraint(self, limits) -> None:
        one_constraint(self.response_format, self.structured_outputs)

    @check
    def check_choice_alone(self, limits) -> None:
        """A choice list is decided by each answer's whole log probability (api/serving/choice_decision.py), not
        token by token: a bias on single tokens has nothing to apply to there, and the answers are scored
        by the model as it is (interventions' positions count from the end of each prompt, which the
        scored answers move)."""
        if self.structured_outputs is None or self.structured_outputs.kind != "choice":
            return
        for name in ("logit_bias", "interventions"):
            if getattr(self, name, None):
                raise InvalidRequest(f"'{name}' cannot be used with 'structured_outputs.choice': the answer is "
                                     "decided by each choice's own log probability as the model gives it, not "
                                     "token by token. Leave out one of the two.", name)

    @property
    def constraint(self) -> Constraint | None:
        """The request's constraint (after `parse`), or None; it knows which field it came from (messages)."""
        if self.response_format is not None:
            return replace(self.response_format, param="response_format")
        return self.structured_outputs

    @property
    def constraint_param(self) -> str:
        return "response_format" if self.response_format is not None else "structured_outputs"
