"""JSON in and out of the HTTP routes: a request's body read under the size and depth caps (with the
contract's messages for what orjson cannot read), and `json_response`, the one JSON answer."""

from __future__ import annotations

import json
import re

import orjson
from fastapi import Request
from starlette.responses import Response

from ...config import Limits
from ..errors import InvalidRequest, RequestTooLarge

# Every backslash escape of a JSON text, in order (so an escaped backslash is not read as an escape's start);
# group 1: the four hex digits of a \uXXXX escape.
ESCAPE = re.compile(rb"\\(?:u([0-9a-fA-F]{4})|.)")


def json_response(payload, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


async def read_json(request: Request, limits: Limits) -> dict:
    """The body as a JSON object, read under the body-size cap."""
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestTooLarge(f"The request body is {int(declared)} bytes, over this server's cap of "
                              f"{limit} bytes (max_body_bytes).")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestTooLarge(f"The request body is over this server's cap of {limit} bytes "
                                  "(max_body_bytes).")
        chunks.append(chunk)
    raw = b"".join(chunks)
    depth_cap = limits.max_json_depth
    too_deep = InvalidRequest(f"The JSON body nests deeper than this server's cap of {depth_cap} levels "
                              "(max_json_depth).")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if "depth" in str(exc) or "recursion" in str(exc):
            raise too_deep from None
        lone = lone_surrogate_at(raw)
        if lone is not None:
            raise lone_surrogate(raw, lone) from None
        raise InvalidRequest("We could not parse the JSON body of your request: it is not valid JSON. "
                             "Send a JSON object with Content-Type: application/json.") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    if raw.count(b"[") + raw.count(b"{") > depth_cap and _deeper_than(body, depth_cap):
        raise too_deep
    return body


def _deeper_than(obj, cap: int) -> bool:
    """Whether containers nest more than `cap` levels (the top object is level 1). Lists of scalars
    (token ids) are checked by type in C, not walked element by element in Python."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > cap:
            return True
        items = node.values() if type(node) is dict else node
        kinds = set(map(type, items))
        if dict in kinds or list in kinds:
            stack.extend((x, depth + 1) for x in items if type(x) is dict or type(x) is list)
    return False


def lone_surrogate_at(raw: bytes) -> int | None:
    """Where the first escape of half a UTF-16 surrogate pair is, when that is all that keeps `raw` from
    being JSON orjson reads (the standard library's parser accepts such escapes); None otherwise. Found
    by scanning the escapes, not from orjson's message, which differs between its versions."""
    try:
        json.loads(raw)
    except (ValueError, RecursionError):
        return None
    high_at, high_end = None, -1
    for match in ESCAPE.finditer(raw):
        code = int(match.group(1), 16) if match.group(1) else None
        if high_at is not None and not (code is not None and 0xDC00 <= code <= 0xDFFF and match.start() == high_end):
            return high_at  # a high half not followed at once by a low one
        if high_at is not None:
            high_at = None  # the pair is whole
        elif code is not None and 0xD800 <= code <= 0xDBFF:
            high_at, high_end = match.start(), match.end()
        elif code is not None and 0xDC00 <= code <= 0xDFFF:
            return match.start()  # a low half with no high one before it
    return high_at


def lone_surrogate(raw: bytes, pos: int) -> InvalidRequest:
    """JSON allows a string escape of half a UTF-16 surrogate pair (`"\\ud800"`), but it is no Unicode
    character: no tokenizer can read it, so it is refused, saying where it is."""
    escape = raw[pos:pos + 6].decode("ascii")
    line = raw.count(b"\n", 0, pos) + 1
    column = len(raw[raw.rfind(b"\n", 0, pos) + 1:pos].decode("utf-8", "replace")) + 1
    return InvalidRequest(
        f"We could not parse the JSON body of your request: it contains a lone UTF-16 surrogate ({escape}) at "
        f"line {line}, column {column}, which is not a Unicode character; a surrogate escape must be a high "
        "one (\\ud800-\\udbff) followed by a low one (\\udc00-\\udfff). Send the text as valid Unicode.")
