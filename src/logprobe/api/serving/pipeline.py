"""The one way in for every request that runs a model: HTTP routes, batch lines (batch/runner.py),
dataset jobs (datasets/scorer.py) and `logprobe score TEXT` (score_cli.py) all go through a `Pipeline`.
It is given what it needs (the models, the limits, the admission and the time-out), never reads an HTTP
request for them, and runs each route's steps in order: parse (the request model's checks), resolve the
model, tokenize (off the event loop), check the caps, then every check of `checks`, build the engine's
requests, hold and run them (or stream them), and format the answer. Each route describes its steps as
an `Endpoint`; a check that every route must pass goes in `CHECKS` (or a pipeline's `checks`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import orjson
from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response, StreamingResponse

from ...backend import INTERACTIVE, GenerationRequest
from ...config import Limits
from ..errors import InvalidRequest, ModelNotFound, new_request_id
from ..shell.json_body import json_response, read_json
from . import choice_decision
from .admission import AdmissionControl
from .holding import Call, Held, Notes, run_jobs
from .output_blocks import iter_body


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
                                                       (framing: shell/sse.py stream_sse's keywords)
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
    # another endpoint on the same path that this parsed request goes to (None: this one): /v1/compare's
    # `align: "text"` is the text spans' endpoint
    variant: Callable[[Any], "Endpoint | None"] = lambda req: None


def asks_whole_vocab(req) -> bool:
    """`prompt_logprobs: -1` (completions and chat)."""
    return req.params.prompt_logprobs == -1


# Checks every endpoint's requests pass after its own caps, wherever they come from (HTTP, a batch line,
# a dataset job, the score CLI): check(endpoint, target, req, prepared, limits), raising an APIError.
CHECKS: list[Callable] = []


@dataclass
class Checked:
    """A request that passed every check, with the engine's requests built: what `run` takes."""

    endpoint: Endpoint
    req: Any
    target: Any
    prepared: Any
    requests: list[GenerationRequest]


@dataclass
class Answer:
    """A request run and formatted: the payload (with `parts` to splice in), the engine's outputs, and
    the hold it ran under (None without admission)."""

    payload: dict
    parts: Any
    outputs: list
    hold: Any = None


class Pipeline:
    """The steps of every request that runs a model, with its dependencies given: `limits`, `admission`
    (api/serving/admission.py or its cluster twin; None: no hold, for a process that serves only its caller),
    `request_timeout` (a function: the setting is read at each request), the served models (`attach`;
    the first is the default where `model` is optional), and `checks` beyond each route's own."""

    def __init__(self, limits: Limits, admission: AdmissionControl | None = None, request_timeout: Callable[[], float | None] = lambda: None,
                 backends=(), checks: list[Callable] | None = None):
        self.limits = limits
        self.admission = admission
        self.request_timeout = request_timeout
        self.checks = checks  # None: the module's CHECKS, as they are at each request
        self.backends: list = []
        self.attach(backends)

    def attach(self, backends) -> None:
        self.backends = list(backends)

    @property
    def backend(self):
        return self.backends[0] if self.backends else None

    def resolve_model(self, name: str | None, required: bool = True, param: str = "model"):
        """The backend serving `name` (full name or alias); 404 for any other name, naming the field
        `param`. Where `model` is optional (the tokenizer paths), none means the first model."""
        if name is None and not required:
            return self.backend
        for backend in self.backends:
            if name == backend.info.name or name in backend.info.aliases:
                return backend
        raise ModelNotFound(name, param)

    # ---- the checks ------------------------------------------------------------------------------
    def route(self, endpoint: Endpoint, req):
        """(endpoint, req, target) of a typed request (what `endpoint.parse` returns): the endpoint that runs
        it (the given one, or its `variant` for this request) and the model(s) it names."""
        endpoint = endpoint.variant(req) or endpoint
        return endpoint, req, endpoint.resolve(req, self.resolve_model)

    def build(self, endpoint: Endpoint, req, target, prepared, request_id: str,
              priority: str = INTERACTIVE) -> Checked:
        """The caps and every check of `checks`, then the engine's requests, each with the caller's
        `priority` (a batch line's "batch" reaches the engine's scheduler on them)."""
        endpoint.check_caps(target, req, prepared, self.limits)
        for check in CHECKS if self.checks is None else self.checks:
            check(endpoint, target, req, prepared, self.limits)
        requests = endpoint.build_requests(target, req, prepared, request_id)
        for request in requests:
            request.priority = priority
        return Checked(endpoint, req, target, prepared, requests)

    def check(self, endpoint: Endpoint, req, request_id: str, priority: str = INTERACTIVE) -> Checked:
        """Every check past the fields of a typed request (the endpoint's, as its `parse` returns it, or
        as a caller in this process builds it: score/serving.py `request`), in the caller's thread (a
        dataset job's rows)."""
        endpoint, req, target = self.route(endpoint, req)
        return self.build(endpoint, req, target, endpoint.tokenize(target, req), request_id, priority)

    async def prepare(self, endpoint: Endpoint, req, call: Call) -> Checked:
        """`check`, tokenizing off the event loop (long texts): the engine's requests built with the call's
        id and priority."""
        endpoint, req, target = self.route(endpoint, req)
        prepared = await run_in_threadpool(endpoint.tokenize, target, req)
        return self.build(endpoint, req, target, prepared, call.request_id, call.priority)

    # ---- running ---------------------------------------------------------------------------------
    async def run(self, checked: Checked, call: Call) -> Answer:
        """Hold, run and format a checked, non-streamed request."""
        (answer,) = await self.run_together([checked], call)
        return answer

    async def run_together(self, many: list[Checked], call: Call, formatted: bool = True) -> list[Answer]:
        """Several checked requests under one hold, each model's requests in one run of its backend (a
        dataset job's chunk: the engine batches them as it would one request of many inputs). Without
        `formatted`, the answers carry the engine's outputs and no payload (a caller in this process
        reads them typed: a dataset job's rows)."""
        jobs: dict[tuple, tuple] = {}  # (id(backend), the job's index in its request) -> (backend, requests)
        spans = []  # per checked request: (job key, first, end) for each of its jobs
        for checked in many:
            mine = []
            for index, (backend, requests) in enumerate(checked.endpoint.jobs(checked.target, checked.requests)):
                key = (id(backend), index)
                _, held = jobs.setdefault(key, (backend, []))
                mine.append((key, len(held), len(held) + len(requests)))
                held.extend(requests)
            spans.append(mine)
        order = list(jobs)
        hold, results = await self._run_jobs(list(jobs.values()), call)
        by_backend = dict(zip(order, results))
        answers = []
        for checked, mine in zip(many, spans):
            outputs = [o for key, first, end in mine for o in by_backend[key][first:end]]  # in the order of requests
            answers.append(await self._format(checked, outputs, hold) if formatted else Answer(None, None, outputs, hold))
        return answers

    async def _run_jobs(self, jobs: list[tuple], call: Call):
        """(hold, results): (backend, requests) jobs run under one hold (none without admission)."""
        if self.admission is None:
            return None, await run_jobs(jobs)
        held = await Held.take(self.admission, call, [r for _, requests in jobs for r in requests],
                               self.request_timeout())  # one hold: the capacity counts every job's requests
        return held.hold, await held.run(jobs)

    async def decide(self, checked: Checked, call: Call) -> Checked:
        """A checked request with what must run before it decided: a `choice` list's answer, from each
        answer's log probability after the prompt (api/serving/choice_decision.py; its scoring runs under a hold
        of its own, given back before the request's). Any other request is returned as it is."""
        async def run(jobs):
            return (await self._run_jobs(jobs, call))[1]

        requests = await choice_decision.decided(run, checked.target, checked.requests, self.limits)
        return checked if requests is checked.requests else replace(checked, requests=requests)

    async def _format(self, checked: Checked, outputs: list, hold) -> Answer:
        endpoint = checked.endpoint
        args = (checked.target, checked.req, checked.prepared, checked.requests, outputs)
        try:
            if endpoint.format_off_loop:  # heavy formatting: in a worker thread
                payload, parts = await run_in_threadpool(endpoint.format_response, *args)
            else:
                payload, parts = endpoint.format_response(*args)
        except BaseException:
            release_arrays(outputs)
            raise
        return Answer(payload, parts, outputs, hold)

    async def answer_whole(self, endpoint: Endpoint, req, call: Call) -> Answer:
        """The answer a POST route gives a typed request (`endpoint.parse`'s, or one a caller in this
        process builds), for a caller without an HTTP connection (a batch line, the score CLI): the same
        steps as `serve`; streaming is refused (param `stream`). Its payload is the answer's JSON as
        objects (with `parts` to splice in, for prompt log probabilities)."""
        checked = await self.prepare(endpoint, req, call)
        if checked.endpoint.stream_formatters is not None and checked.req.stream:
            raise InvalidRequest("Invalid value for 'stream': a batch line is answered whole; streaming is not "
                                 "available in a batch. Remove 'stream' or set it to false.", "stream")
        checked = await self.decide(checked, call)
        return await self.run(checked, call)

    async def answer(self, endpoint: Endpoint, body: dict, call: Call) -> bytes:
        """`answer_whole` as the JSON body's bytes (a batch line's response body)."""
        answer = await self.answer_whole(endpoint, endpoint.parse(body, self.limits), call)
        try:
            if answer.parts:
                return await run_in_threadpool(lambda: b"".join(iter_body(answer.payload, answer.parts)))
            return orjson.dumps(answer.payload)
        finally:
            release_arrays(answer.outputs)

    # ---- HTTP ------------------------------------------------------------------------------------
    async def serve(self, request: Request, endpoint: Endpoint) -> Response:
        """An HTTP POST route. Nothing is held or queued before every check has passed."""
        call = http_call(request)
        checked = await self.prepare(endpoint, endpoint.parse(await read_json(request, self.limits), self.limits), call)
        checked = await self.decide(checked, call)
        req, endpoint = checked.req, checked.endpoint
        if endpoint.stream_formatters is not None and req.stream:
            format_deltas, final_chunks, *framing = endpoint.stream_formatters(checked.target, req, checked.prepared,
                                                                               checked.requests)
            held = await Held.take(self.admission, call, checked.requests, self.request_timeout())
            return await held.stream(checked.target, req.params.logprobs or 0, format_deltas, final_chunks,
                                     **(framing[0] if framing else {}))
        answer = await self.run(checked, call)
        return with_headers(await body_response(answer.payload, answer.parts, endpoint.whole_vocab(req),
                                                answer.outputs), answer.hold.headers)


def http_call(request: Request) -> Call:
    """An HTTP request as the pipeline's caller: the gate's request id and key, interactive (a batch line
    is a call of the batch runner's, batch/runner.py), gone when the client disconnects, and the hold and
    usage noted where the gate's access log reads them."""
    state = request.scope.setdefault("state", {})

    async def disconnected() -> None:  # the body was read already
        while (await request.receive())["type"] != "http.disconnect":
            pass

    notes = state.setdefault("notes", Notes())  # the gate's (app.py), which its access log reads
    return Call(state.get("request_id") or new_request_id(), state.get("key_id", "anonymous"),
                INTERACTIVE, disconnected, notes)


async def serve(request: Request, endpoint: Endpoint) -> Response:
    """An HTTP POST route, through the app's pipeline."""
    return await request.app.state.pipeline.serve(request, endpoint)


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
