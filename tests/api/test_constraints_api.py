"""The constraint fields over HTTP on the fake backend: `response_format` and `structured_outputs` into
`SamplingParams.constraint`, every refusal with its param (vLLM's removed fields name their
replacement; a schema, regex or grammar that does not compile is refused before anything is queued),
and their place in the OpenAPI schema."""

from __future__ import annotations

import json

import pytest

from logprobe.api.chat import serving as chat
from logprobe.api.completions import serving as completions
from logprobe.api.score import serving as scoring
from logprobe.backend import Constraint
from logprobe.config import Limits

MESSAGES = [{"role": "user", "content": "Answer."}]
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
PATHS = {"/v1/completions": {"prompt": "Answer:"}, "/v1/chat/completions": {"messages": MESSAGES},
         "/v1/score": {"input": "12"}}


def refused(client, path, **body):
    before = len(client.app.state.backend.calls) if hasattr(client.app.state.backend, "calls") else None
    r = client.post(path, json={"model": "tiny", **PATHS[path], **body})
    assert r.status_code == 400, r.text
    if before is not None:
        assert len(client.app.state.backend.calls) == before  # nothing reached the backend
    return r.json()["error"]


@pytest.mark.parametrize("field, replacement", [
    ("guided_json", "structured_outputs.json"), ("guided_regex", "structured_outputs.regex"),
    ("guided_choice", "structured_outputs.choice"), ("guided_grammar", "structured_outputs.grammar"),
    ("guided_whitespace_pattern", "structured_outputs.whitespace_pattern"),
])
@pytest.mark.parametrize("path", list(PATHS))
def test_removed_vllm_fields_name_their_replacement(fake_client, path, field, replacement):
    error = refused(fake_client, path, **{field: "[0-9]+"})
    assert error["param"] == field
    assert f"'{replacement}'" in error["message"] and "removed" in error["message"]


def test_guided_decoding_backend_is_refused(fake_client):
    error = refused(fake_client, "/v1/completions", guided_decoding_backend="xgrammar")
    assert error["param"] == "guided_decoding_backend" and "llguidance" in error["message"]


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("body, param, words", [
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex", "unclosed character class"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar", "unknown name"),
    ({"structured_outputs": {"json": {"type": "objectx"}}}, "structured_outputs.json", "objectx"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"json": 3}}, "structured_outputs.json", "JSON schema"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty array of strings"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice", "array of strings"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", "Unrecognized"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace", "only used with"),
    ({"structured_outputs": "json"}, "structured_outputs", "object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema", "objectx"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a",
                                                                  "schema": {"$ref": "#/nowhere"}}}},
     "response_format.json_schema.schema", "nowhere"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "Missing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name", "Missing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": "yes"}}},
     "response_format.json_schema.strict", "boolean"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "'json_schema'"),
    ({"response_format": {"type": "text", "extra": 1}}, "response_format.extra", "Unrecognized"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "not both"),
])
def test_refusals_name_the_param(fake_client, path, body, param, words):
    error = refused(fake_client, path, **body)
    assert error["param"] == param, error
    assert words in error["message"], error


@pytest.mark.parametrize("body, expected", [
    ({}, None),
    ({"response_format": None}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, Constraint("json_object", "")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     Constraint("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
    ({"structured_outputs": {"json": SCHEMA}}, Constraint("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
    ({"structured_outputs": {"json": json.dumps(SCHEMA, indent=2)}},
     Constraint("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
    ({"structured_outputs": {"regex": "[0-9]+"}}, Constraint("regex", "[0-9]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, Constraint("choice", '["yes", "no"]')),
    ({"structured_outputs": {"grammar": 'start: "a"'}}, Constraint("grammar", 'start: "a"')),
    ({"structured_outputs": {"json_object": True}}, Constraint("json_object", "")),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
     Constraint("json_schema", '{"type":"object","x-guidance":{"whitespace_flexible":false}}')),
    ({"structured_outputs": {"json": {"type": "integer"}, "whitespace_pattern": " ?"}},
     Constraint("json_schema", '{"type":"integer","x-guidance":{"whitespace_pattern":" ?"}}')),
])
def test_fields_become_the_constraint(body, expected):
    limits = Limits()
    assert completions.parse({"model": "tiny", "prompt": "x", **body}, limits).params.constraint == expected
    assert chat.parse({"model": "tiny", "messages": MESSAGES, **body}, limits).params.constraint == expected
    assert scoring.parse({"model": "tiny", "input": "x", **body}, limits).constraint == expected


def test_schema_key_order_is_kept():
    """llguidance writes an object's properties in the schema's order, so the order is part of the
    constraint (and of its cache key)."""
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    params = completions.parse({"model": "tiny", "prompt": "x", "structured_outputs": {"json": schema}}, Limits()).params
    assert params.constraint.source.index('"b"') < params.constraint.source.index('"a"')


def test_score_text_outside_the_constraint_is_refused_where_it_leaves(fake_client):
    error = refused(fake_client, "/v1/score", input=["123", "12a4"], structured_outputs={"regex": "[0-9]+"})
    assert error["param"] == "input"
    assert "input 1" in error["message"] and "character 2" in error["message"]
    assert "'structured_outputs'" in error["message"]


def test_score_under_a_constraint_is_capped_by_the_whole_vocabulary_cap(fake_backend):
    from fastapi.testclient import TestClient

    from logprobe.api.app import create_app

    app = create_app(fake_backend, Limits(max_vocab_positions=4))
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/v1/score", json={"model": "tiny", "input": "123456789", "structured_outputs": {"regex": "[0-9]+"}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "input" and "max_vocab_positions" in r.json()["error"]["message"]
        r = c.post("/v1/score", json={"model": "tiny", "input": "123456789"})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("body_name", ["CompletionBody", "ChatBody", "ScoreBody"])
def test_openapi_schema_has_the_fields(fake_client, body_name):
    schemas = fake_client.get("/openapi.json").json()["components"]["schemas"]
    fields = schemas[body_name]["properties"]
    assert "response_format" in fields and "structured_outputs" in fields
    options = schemas["StructuredOutputs"]["properties"]
    assert {"json", "regex", "choice", "grammar", "json_object"} <= set(options)
    assert set(schemas["ResponseFormat"]["properties"]["type"]["enum"]) == {"text", "json_object", "json_schema"}


def metric(client, name: str) -> float:
    text = client.get("/metrics").text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_metrics_count_compiles_and_hits(fake_client):
    regex = {"regex": "[0-7]{3}z"}  # compiled by no other test
    misses, hits = metric(fake_client, "logprobe_grammar_cache_misses"), metric(fake_client, "logprobe_grammar_cache_hits")
    for _ in range(2):
        r = fake_client.post("/v1/score", json={"model": "tiny", "input": "12", "structured_outputs": regex})
        assert r.status_code == 200, r.text
    assert metric(fake_client, "logprobe_grammar_cache_misses") == misses + 1
    assert metric(fake_client, "logprobe_grammar_cache_hits") >= hits + 1
    assert metric(fake_client, "logprobe_grammar_cache_compile_seconds") > 0
