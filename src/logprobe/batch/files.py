"""The checks of an uploaded batch file and of a new batch, and the objects the routes answer with, in
OpenAI's shapes (the openai SDK reads them unchanged).

An uploaded file (purpose `batch`) must be JSONL: every non-empty line a JSON object with a unique
string `custom_id`, `method` "POST", a `url` this server runs in a batch and a `body` object. A new
batch checks its file against its `endpoint` and the served models, and the size caps. Each refusal
names its param; a line's *body* is checked only when the line runs, by the endpoint itself, so a bad
body is an error-file entry with the envelope the endpoint gives, not a refused batch.
"""

from __future__ import annotations

import orjson
from pydantic import ConfigDict, Field
from typing import Literal

from ..api.checks import validation as v
from ..api.errors import APIError, InvalidRequest
from ..api.checks.schema import RequestModel, parses
from ..api.registry import BATCH_PATHS
from ..config import Limits

ENDPOINTS = BATCH_PATHS  # the registry's endpoints a batch may name
WINDOW_S = 24 * 3600


class NotFound(APIError):
    """404: a file or batch that does not exist or belongs to another key (the same answer for both)."""

    status = 404
    code = "not_found"


def no_such(kind: str, object_id: str, param: str | None = None) -> NotFound:
    return NotFound(f"No such {kind}: '{object_id}'.", param)


class BatchBody(RequestModel):
    """POST /v1/batches."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"input_file_id": "file-abc123", "endpoint": "/v1/score", "completion_window": "24h"}]})

    input_file_id: str = Field(..., description="The id of an uploaded file of purpose `batch` (JSONL).")
    endpoint: Literal[BATCH_PATHS] = Field(
        ..., description="The endpoint every line's `url` names.")
    completion_window: Literal["24h"] = Field(..., description="The batch expires, its undone lines in the "
                                              "error file, 24 hours after it was created.")
    metadata: dict[str, str] | None = Field(None, description="Up to 16 string pairs kept with the batch "
                                            "(keys up to 64 characters, values up to 512).")

    @parses("metadata")
    def parse_metadata(value, limits: Limits) -> dict | None:
        if value is None:
            return None
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(x, str) for k, x in value.items()):
            raise v.type_error("metadata", "an object of string values")
        if len(value) > 16 or any(len(k) > 64 or len(x) > 512 for k, x in value.items()):
            raise v.value_error("metadata", "at most 16 pairs, keys up to 64 characters, values up to 512")
        return value


def read_batch_file(data: bytes) -> list[dict]:
    """The request lines of an uploaded batch file (blank lines skipped); 400 (param `file`) naming the
    first line that is not a request, and a repeated `custom_id`."""
    requests, seen = [], set()
    for number, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            line = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise InvalidRequest(f"The file is not JSONL: line {number} is not valid JSON. A batch file has one "
                                 "JSON request object a line.", "file") from None
        if not isinstance(line, dict):
            raise InvalidRequest(f"Line {number} of the file is not a JSON object.", "file")
        problem = line_problem(line)
        if problem:
            raise InvalidRequest(f"Line {number} of the file {problem}.", "file")
        if line["custom_id"] in seen:
            raise InvalidRequest(f"Line {number} of the file repeats the custom_id {line['custom_id']!r}: each "
                                 "line's custom_id must be unique in the file.", "file")
        seen.add(line["custom_id"])
        requests.append(line)
    if not requests:
        raise InvalidRequest("The file has no request lines.", "file")
    return requests


def line_problem(line: dict) -> str | None:
    if not isinstance(line.get("custom_id"), str):
        return "has no string 'custom_id'"
    if line.get("method") != "POST":
        return "has a 'method' other than \"POST\""
    if line.get("url") not in ENDPOINTS:
        return f"has a 'url' that is not one of {', '.join(ENDPOINTS)}"
    if not isinstance(line.get("body"), dict):
        return "has no 'body' object"
    unknown = set(line) - {"custom_id", "method", "url", "body"}
    if unknown:
        return f"has an unknown field {sorted(unknown)[0]!r}"
    return None


def batch_lines(data: bytes, endpoint: str, resolve_model, max_lines: int):
    """(model, [(custom_id, body bytes, sort context, sort length)]) of a new batch's file, or 400
    (param `input_file_id`): too many lines, a line for another endpoint, or for a model this server
    does not serve or another than the first line's."""
    requests = read_batch_file(data)
    if len(requests) > max_lines:
        raise InvalidRequest(f"The file has {len(requests)} lines, more than this server runs in one batch "
                             f"({max_lines}, max_batch_lines). Split it.", "input_file_id")
    first_model, out = None, []
    for number, line in enumerate(requests, 1):
        if line["url"] != endpoint:
            raise InvalidRequest(f"Line {number} ({line['custom_id']!r}) is for {line['url']}, not for the batch's "
                                 f"endpoint {endpoint}: a batch runs one endpoint.", "input_file_id")
        body = line["body"]
        named = body.get("models") if endpoint == "/v1/compare" else body.get("model")
        model = model_key(named, resolve_model, number, line["custom_id"])
        if model is not None:
            if first_model is not None and model != first_model:
                raise InvalidRequest(f"Line {number} ({line['custom_id']!r}) names the model {named!r}, another "
                                     "than the batch's first line: a batch runs one model.", "input_file_id")
            first_model = first_model or model
        ctx, length = sort_key(endpoint, body)
        out.append((line["custom_id"], orjson.dumps(body), ctx, length))
    return (", ".join(first_model) if first_model else None), out


def model_key(named, resolve_model, number: int, custom_id: str) -> tuple | None:
    """The served models' names a line runs on (None when the body does not name them in a form its
    endpoint takes: the endpoint's own check answers that line)."""
    names = named if isinstance(named, list) else [named]
    if not names or not all(isinstance(n, str) for n in names):
        return None
    try:
        return tuple(resolve_model(n).info.name for n in names)
    except APIError:
        raise InvalidRequest(f"Line {number} ({custom_id!r}) names the model {named!r}, which this server does "
                             "not serve.", "input_file_id") from None


def sort_key(endpoint: str, body: dict) -> tuple[str, int]:
    """The engine's order of a batch's lines: lines that share a context (a score's `context`, a chat's
    messages before the last) next to each other, so the prefix cache keeps it; within it, shortest
    first, so passes batch lines of like lengths (the body's size stands for its tokens)."""
    if endpoint == "/v1/chat/completions" and isinstance(body.get("messages"), list):
        ctx = orjson.dumps(body["messages"][:-1]).decode()
    else:
        ctx = body.get("context") if isinstance(body.get("context"), str) else ""
    return ctx, len(orjson.dumps(body))


# ---- the objects ---------------------------------------------------------------------------------------


def file_object(row: dict) -> dict:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
            "expires_at": row["expires_at"], "status_details": None}


def batch_object(row: dict) -> dict:
    errors = orjson.loads(row["errors"]) if row["errors"] else None
    return {
        "id": row["id"], "object": "batch", "endpoint": row["endpoint"], "model": row["model"],
        "errors": None if errors is None else {"object": "list", "data": errors},
        "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
        "status": row["status"], "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
        "created_at": row["created_at"], "in_progress_at": row["in_progress_at"], "expires_at": row["expires_at"],
        "finalizing_at": row["finalizing_at"], "completed_at": row["completed_at"], "failed_at": row["failed_at"],
        "expired_at": row["expired_at"], "cancelling_at": row["cancelling_at"], "cancelled_at": row["cancelled_at"],
        "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
        "metadata": orjson.loads(row["metadata"]) if row["metadata"] else None,
    }


def page(objects: list[dict], has_more: bool) -> dict:
    return {"object": "list", "data": objects, "first_id": objects[0]["id"] if objects else None,
            "last_id": objects[-1]["id"] if objects else None, "has_more": has_more}
