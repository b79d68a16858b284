"""The request bodies: one pydantic model per POST route, from which come both the route's checks
(`Model.parse(body, limits)`, the contract's messages) and the OpenAPI schema of its body."""

from __future__ import annotations

from .base import RequestModel
from .completions import ChatBody, CompletionBody
from .responses import ResponsesBody
from .scoring import CompareBody, ScoreBody
from .tokenizer import DetokenizeBody, TokenizeBody
from .tree import TreeBody

BODIES: dict[str, type[RequestModel]] = {
    "/v1/completions": CompletionBody,
    "/v1/chat/completions": ChatBody,
    "/v1/responses": ResponsesBody,
    "/v1/score": ScoreBody,
    "/v1/compare": CompareBody,
    "/v1/tree": TreeBody,
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
