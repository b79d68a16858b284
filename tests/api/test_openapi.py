"""/openapi.json describes every request body (and stays in step with what the routes accept), passes
an OpenAPI validator, and its examples are requests the server takes; /docs and /redoc work offline."""

from __future__ import annotations

import re

import pytest
from openapi_spec_validator import validate

from logprobe.api.registry import BODIES

# The fields each route takes (its request model's, the neutral-only OpenAI ones included) and the
# required ones, as the contract lists them
ACCEPTED = {path: (set(model.model_fields), required) for path, model, required in [
    ("/v1/completions", BODIES["/v1/completions"], {"model", "prompt"}),
    ("/v1/chat/completions", BODIES["/v1/chat/completions"], {"model", "messages"}),
    ("/v1/responses", BODIES["/v1/responses"], {"model", "input"}),
    ("/v1/score", BODIES["/v1/score"], {"model"}),  # and one of input and messages (a cross-field rule)
    ("/v1/compare", BODIES["/v1/compare"], {"models", "input"}),
    ("/tokenize", BODIES["/tokenize"], set()),  # and one of prompt and messages (a cross-field rule)
    ("/detokenize", BODIES["/detokenize"], {"tokens"}),
    ("/v1/tree", BODIES["/v1/tree"], {"model"}),
]}


@pytest.fixture(scope="module")
def schema(fake_client):
    return fake_client.get("/openapi.json").json()


def body_schema(schema, path):
    ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return schema["components"]["schemas"][ref.rsplit("/", 1)[1]]


def test_schema_is_valid_openapi(schema):
    validate(schema)


def test_every_post_has_a_described_body(schema):
    posts = [p for p, item in schema["paths"].items() if "post" in item]
    assert sorted(posts) == sorted(BODIES) == sorted(ACCEPTED)
    for path in posts:
        body = body_schema(schema, path)
        assert body["properties"] and body["additionalProperties"] is False


@pytest.mark.parametrize("path", sorted(ACCEPTED))
def test_described_fields_are_the_accepted_ones(schema, path):
    accepted, required = ACCEPTED[path]
    body = body_schema(schema, path)
    assert set(body["properties"]) == accepted
    assert set(body.get("required", [])) == required
    for name, prop in body["properties"].items():
        assert prop.get("description"), f"{path}: {name} undescribed"


def test_bounds_and_defaults_are_described(schema):
    cmpl = body_schema(schema, "/v1/completions")["properties"]
    assert cmpl["max_tokens"]["default"] == 16
    assert any(t.get("maximum") == 100 for t in cmpl["logprobs"]["anyOf"])
    assert any(t.get("minimum") == -1 for t in cmpl["prompt_logprobs"]["anyOf"])
    assert any(t.get("maximum") == 2 for t in cmpl["temperature"]["anyOf"])


@pytest.mark.parametrize("path", sorted(BODIES))
def test_examples_are_requests_the_server_takes(fake_client, pair_client, path):
    examples = BODIES[path].model_config["json_schema_extra"]["examples"]
    assert examples
    for example in examples:
        if path == "/v1/compare":  # two models, named as in the examples (`base`, `tuned`)
            r = pair_client.post(path, json=example)
        else:
            r = fake_client.post(path, json={**example, "model": "tiny"})
        assert r.status_code == 200, (example, r.text)


def test_metrics_and_playground_are_left_out_on_purpose(schema):
    assert "/metrics" not in schema["paths"] and "/" not in schema["paths"]
    assert "/metrics" in schema["info"]["description"]


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_load_nothing_from_elsewhere(fake_client, page):
    r = fake_client.get(page)
    assert r.status_code == 200
    html = r.text
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html), "an asset from another host"
    assets = re.findall(r"""(?:src|href)=["']([^"']+)["']""", html)
    assert assets
    for url in assets:
        got = fake_client.get(url)
        assert got.status_code == 200 and got.content, url
        if url.endswith((".js", ".css")):  # the pages' code itself, not a stub (the favicon is ~0.4 KB)
            assert len(got.content) > 1000, url
