"""The one pipeline of the POST routes that run a model: read the JSON body, parse it (the request
model's checks), resolve the model, tokenize (off the event loop), check the caps, build the engine's
requests, hold and run them (or stream them), and format the answer. Each route describes its steps
as an `Endpoint`; `serve` runs any of them."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response, StreamingResponse

from ..backend import GenerationRequest
from ..config import Limits
from .errors import InvalidRequest, ModelNotFound, RequestTooLarge
from .holding import admit, run_held_jobs, stream_held
from .output_blocks import iter_body

# Every backslash escape of a JSON text, in order (so an escaped backslash is not read as an escape's start);
# group 1: the four hex digits of a \uXXXX escape.
ESCAPE = re.compile(rb"\\(?:u([0-9a-fA-F]{4})|.)")


def json_response(payload, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


async def read_json(request: Request) -> dict:
    """The body as a JSON object, read under the body-size cap."""
    limit = request.app.state.limits.max_body_bytes
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
    depth_cap = request.app.state.limits.max_json_depth
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


@dataclass(frozen=True)
class Endpoint:
    """One POST route's steps, each a function of the route's module (`target`: the backend the request
    names, or what `resolve` returns; `prepared`: what `tokenize` returns):

        parse(body, limits) -> req                     field types and values (400)
        resolve(req, resolve_model) -> target          the model(s) (404)
        tokenize(target, req) -> prepared              off the event loop
        check_caps(target, req, prepared, limits)      context and size caps (400)
        build_requests(target, req, prepared, request_id) -> list[GenerationRequest]
        format_response(target, req, prepared, requests, outputs) -> (payload, Parts or None)
        stream_formatters(target, req, prepared, requests) -> (format_deltas, final_chunks[, framing])
                                                       (framing: streaming.stream_sse's keywords)
    """

    parse: Callable[[dict, Limits], Any]
    tokenize: Callable
    check_caps: Callable
    build_requests: Callable[..., list[GenerationRequest]]
    format_response: Callable
    stream_formatters: Callable | None = None  # None: the route does not stream
    resolve: Callable = lambda req, resolve_model: resolve_model(req.model)
    jobs: Callable[[Any, list], list[tuple]] = lambda target, requests: [(target, requests)]  # (backend, requests)
    format_off_loop: bool = False  # heavy formatting (two [P, V] rows compared): in a worker thread
    # whether the answer holds whole-vocabulary rows (hundreds of MB: streamed out as they are encoded)
    whole_vocab: Callable[[Any], bool] = lambda req: False


def asks_whole_vocab(req) -> bool:
    """`prompt_logprobs: -1` (completions and chat)."""
    return req.params.prompt_logprobs == -1


def resolve_model(request: Request, name: str | None, required: bool = True):
    """The backend serving `name` (full name or alias); 404 for any other name. Where `model` is optional
    (the tokenizer paths), none means the first model."""
    if name is None and not required:
        return request.app.state.backend
    for backend in request.app.state.backends:
        if name == backend.info.name or name in backend.info.aliases:
            return backend
    raise ModelNotFound(name)


async def serve(request: Request, endpoint: Endpoint) -> Response:
    """Run a POST route's steps. Nothing is held or queued before every check has passed."""
    req, target, prepared, requests = await prepare(request, endpoint, await read_json(request))
    if endpoint.stream_formatters is not None and req.stream:
        format_deltas, final_chunks, *framing = endpoint.stream_formatters(target, req, prepared, requests)
        hold = await admit(request, requests)
        return stream_held(request, target, requests, hold, req.params.logprobs or 0, format_deltas, final_chunks,
                           **(framing[0] if framing else {}))
    hold, outputs, payload, parts = await run_and_format(request, endpoint, req, target, prepared, requests)
    return with_headers(await body_response(payload, parts, endpoint.whole_vocab(req), outputs), hold.headers)


async def prepare(request: Request, endpoint: Endpoint, body: dict):
    """The checks and the engine's requests of a parsed JSON body: (req, target, prepared, requests)."""
    limits = request.app.state.limits
    req = endpoint.parse(body, limits)
    target = endpoint.resolve(req, lambda name: resolve_model(request, name))
    prepared = await run_in_threadpool(endpoint.tokenize, target, req)  # long texts: off the event loop
    endpoint.check_caps(target, req, prepared, limits)
    requests = endpoint.build_requests(target, req, prepared, request.state.request_id)
    return req, target, prepared, requests


async def run_and_format(request: Request, endpoint: Endpoint, req, target, prepared, requests):
    """Hold, run and format a checked, non-streamed request: (hold, outputs, payload, parts)."""
    hold, results = await run_held_jobs(request, endpoint.jobs(target, requests))
    outputs = [output for job_outputs in results for output in job_outputs]  # in the order of `requests`
    try:
        if endpoint.format_off_loop:
            payload, parts = await run_in_threadpool(endpoint.format_response, target, req, prepared, requests,
                                                     outputs)
        else:
            payload, parts = endpoint.format_response(target, req, prepared, requests, outputs)
    except BaseException:
        release_arrays(outputs)
        raise
    return hold, outputs, payload, parts


async def answer_bytes(request, endpoint: Endpoint, body: dict) -> bytes:
    """The JSON body a POST route answers for `body`, for a caller without an HTTP connection of its own
    (a batch line, batch/runner.py): `request` carries `app` and a `state` with the owner's `key_id`,
    a `request_id` and a `priority`; its `receive` says `http.disconnect` when the caller gives up.
    The same steps as `serve`; streaming is refused (param `stream`)."""
    req, target, prepared, requests = await prepare(request, endpoint, body)
    if endpoint.stream_formatters is not None and req.stream:
        raise InvalidRequest("Invalid value for 'stream': a batch line is answered whole; streaming is not "
                             "available in a batch. Remove 'stream' or set it to false.", "stream")
    _, outputs, payload, parts = await run_and_format(request, endpoint, req, target, prepared, requests)
    try:
        if parts:
            return await run_in_threadpool(lambda: b"".join(iter_body(payload, parts)))
        return orjson.dumps(payload)
    finally:
        release_arrays(outputs)


def with_headers(response: Response, headers: dict) -> Response:
    response.headers.update(headers)
    return response


async def body_response(payload: dict, parts, whole_vocab: bool, outputs) -> Response:
    """The JSON answer; prompt_logprobs parts are encoded off the event loop, and a whole-vocabulary
    answer (hundreds of MB) is streamed block by block as it is encoded. Once the body is written the
    outputs' large arrays are let go at once (`release_arrays`)."""
    if whole_vocab:
        def body():
            try:
                yield from iter_body(payload, parts)
            finally:
                release_arrays(outputs)

        return StreamingResponse(body(), media_type="application/json")
    try:
        if parts:
            body = await run_in_threadpool(lambda: b"".join(iter_body(payload, parts)))
            return Response(body, media_type="application/json")
        return json_response(payload)
    finally:
        release_arrays(outputs)


def release_arrays(outputs) -> None:
    """Drop the whole-vocabulary rows and activations of answered outputs. The records may outlive the
    response in reference cycles that only the garbage collector's rare full passes free (anyio's and
    Starlette's exception tracebacks hold the frames that hold them): measured on Gemma 3's 262,144-token
    vocabulary, ~250 MB more private memory after each whole-vocabulary answer, for eight answers."""
    for output in outputs:
        if output.prompt_columns is not None:
            output.prompt_columns.full = output.prompt_columns.full_ranks = None
        for choice in output.choices:
            choice.residual = None
