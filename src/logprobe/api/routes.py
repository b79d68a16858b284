"""HTTP routes. Thin: parse and check, hand over to the backend (backend.py), format."""

from __future__ import annotations

import asyncio
import time

import orjson
from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response, StreamingResponse

from ..backend import BackendUnavailable, GenerationOutput, GenerationRequest
from . import chat
from . import completions as cmpl
from . import comparing, scoring
from .common import Parts, iter_body
from .streaming import stream_sse
from . import validation as v
from .errors import InvalidRequest, ModelNotFound, RequestTooLarge, Timeout, Unavailable

router = APIRouter()
CREATED = int(time.time())


def _json(payload, status: int = 200) -> Response:
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


class BackendLost(Unavailable):
    """503 `unavailable`: the backend lost the request (its replica died); nothing is charged for it."""


class ClientGone(Exception):
    """The client closed the connection before its answer was ready; `generated`: the tokens generated
    for it until then."""

    def __init__(self, generated: int = 0):
        super().__init__()
        self.generated = generated


def generated_so_far(jobs: list[tuple]) -> int:
    """Tokens generated so far for the requests of the (backend, requests) jobs still running, from the
    backends that can tell (`generated`: the in-process engine; a Ray Serve replica cannot be asked,
    so behind `--replicas` an abandoned plain request is charged its prompt only, as docs/serving.md says)."""
    total = 0
    for backend, requests in jobs:
        count = getattr(backend, "generated", None)
        if count is not None:
            total += sum(count(rid) for rid in dict.fromkeys(r.request_id for r in requests))
    return total


async def run_while_connected(request: Request, backend, requests: list[GenerationRequest]) -> list[GenerationOutput]:
    """Run requests on the backend; if the client disconnects first, abort them (the backend drops them
    before their next step) instead of finishing work nobody will read; the same, with 504, when they
    run past the request time-out. A backend that lost the requests (a replica died) answers 503."""
    (outputs,) = await run_jobs_while_connected(request, [(backend, requests)])
    return outputs


async def run_jobs(jobs: list[tuple]) -> list[list[GenerationOutput]]:
    """Run each (backend, requests) job at the same time; when one fails or the whole is cancelled, the
    others are cancelled too (their backends abort them), and waited for."""
    tasks = [asyncio.ensure_future(backend.run(requests)) for backend, requests in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_jobs_while_connected(request: Request, jobs: list[tuple]) -> list[list[GenerationOutput]]:
    """run_while_connected for (backend, requests) jobs on one or more backends, run at the same time."""
    single = len(jobs) == 1  # one backend: its own run, without a wrapping task
    run = asyncio.ensure_future(jobs[0][0].run(jobs[0][1]) if single else run_jobs(jobs))

    watcher = asyncio.ensure_future(disconnected(request))
    timeout = request.app.state.settings.request_timeout or None
    try:
        await asyncio.wait({run, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not run.done():
            generated = generated_so_far(jobs)
            run.cancel()  # the backend aborts the requests
            await asyncio.gather(run, return_exceptions=True)
            if watcher.done() and not watcher.cancelled():
                raise ClientGone(generated)
            stopped = Timeout(f"The request ran longer than this server's limit of {timeout:g} s "
                              "(request_timeout) and was stopped.")
            stopped.generated = generated
            raise stopped
    try:
        return [run.result()] if single else run.result()
    except BackendUnavailable as exc:
        raise BackendLost(str(exc) or "The model replica serving this request went away; try again.") from None


def held_tokens(requests: list[GenerationRequest]) -> int:
    """What the hold takes: (prompt tokens + max_tokens) x n, summed over the requests (prompts)."""
    return sum((r.num_prompt_tokens + r.params.max_tokens) * r.params.n for r in requests)


async def admit(request: Request, requests: list[GenerationRequest]):
    """Hold the request's tokens (waiting in the queue if need be); see admission.py. A client that
    leaves while its request waits takes it out of the queue at once (ClientGone: logged 499), so it
    blocks nobody behind it."""
    admission = request.app.state.admission
    acquiring = asyncio.ensure_future(admission.acquire(request.state.key_id, held_tokens(requests)))
    watcher = None
    try:
        await asyncio.sleep(0)  # acquire runs to its first wait: a request admitted at once is done here
        if not acquiring.done():
            watcher = asyncio.ensure_future(disconnected(request))
            await asyncio.wait({acquiring, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not acquiring.done():
                raise ClientGone()
    except BaseException:  # the client left, or this handler was cancelled (shutdown): no hold stays
        if acquiring.done():
            if not acquiring.cancelled() and acquiring.exception() is None:
                admission.release(acquiring.result(), used=0)
        else:
            acquiring.cancel()  # acquire takes the waiter out (and gives back a hold made meanwhile)
            await asyncio.gather(acquiring, return_exceptions=True)
        raise
    finally:
        if watcher is not None:
            watcher.cancel()
    hold = acquiring.result()
    request.state.hold = hold
    return hold


async def disconnected(request: Request) -> None:
    """Returns when the client has closed the connection (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def release(request: Request, hold, requests: list[GenerationRequest], completion: int, lost: bool = False) -> None:
    """The request is over (done, failed, timed out or abandoned): give back its hold, and record its
    usage for the access log and the metrics. The key's budget is charged the prompt tokens (x n) and
    the tokens generated, except for a request the backend lost (its replica died): only what it sent."""
    prompt = sum(r.num_prompt_tokens for r in requests)
    request.state.usage = (prompt, completion)
    used = completion if lost else sum(r.num_prompt_tokens * r.params.n for r in requests) + completion
    request.app.state.admission.release(hold, used=used)


class HeldStream(StreamingResponse):
    """A streamed answer that gives back its hold when it ends, however it ends (finished, client gone,
    cancelled by shutdown), even if its body was never iterated."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
            self.on_close()


async def run_held(request: Request, backend, requests: list[GenerationRequest]):
    hold, (outputs,) = await run_held_jobs(request, [(backend, requests)])
    return hold, outputs


async def run_held_jobs(request: Request, jobs: list[tuple]):
    """Hold the tokens of every (backend, requests) job at once (one hold: the capacity counts them
    all), run the jobs, give the hold back. Returns the hold and each job's outputs."""
    requests = [r for _, job_requests in jobs for r in job_requests]
    hold = await admit(request, requests)
    results, lost, generated = None, False, 0
    try:
        results = await run_jobs_while_connected(request, jobs)
        generated = sum(o.num_generated for outputs in results for o in outputs)
    except BackendLost:
        lost = True
        raise
    except (ClientGone, Timeout) as exc:  # stopped: what was generated until then is charged too
        generated = getattr(exc, "generated", 0)
        raise
    finally:
        release(request, hold, requests, generated, lost)
    return hold, results


def stream_held(request: Request, backend, requests, hold, k: int, format_deltas, final_chunks) -> StreamingResponse:
    usage = {"completion": 0, "lost": False}

    def on_end(end, released, lost):
        usage["completion"] = sum(end.num_generated) if end is not None else released
        usage["lost"] = lost

    gen = stream_sse(backend, requests, k, request.state.request_id, format_deltas, final_chunks,
                     timeout=request.app.state.settings.request_timeout or None, on_end=on_end)
    return HeldStream(gen, lambda: release(request, hold, requests, usage["completion"], usage["lost"]),
                      media_type="text/event-stream",
                      headers={"cache-control": "no-cache", "x-accel-buffering": "no", **hold.headers})


def resolve_model(request: Request, name: str | None, required: bool = True):
    """The backend serving `name` (full name or alias); 404 for any other name. Where `model` is optional
    (the tokenizer paths), none means the first model."""
    if name is None and not required:
        return request.app.state.backend
    for backend in request.app.state.backends:
        if name == backend.info.name or name in backend.info.aliases:
            return backend
    raise ModelNotFound(name)


def model_card(backend, limits) -> dict:
    info = backend.info
    return {
        "id": info.name, "object": "model", "created": CREATED, "owned_by": "logprobe",
        "aliases": info.aliases, "num_layers": info.num_layers, "d_model": info.d_model,
        "vocab_size": info.vocab_size, "context_length": info.context_length, "max_model_len":
        info.context_length, "dtype": info.dtype, "quantization": info.quantization, "runner": info.runner, "bos_token": info.bos_token, "eos_token": info.eos_token,
        "adds_bos": info.adds_bos, "has_chat_template": info.has_chat_template,
        "limits": {**limits.as_dict(), "context_length": info.context_length,
                   # the whole-vocabulary position caps for this model's vocabulary (max_vocab_entries)
                   "vocab_positions": limits.vocab_positions(info.vocab_size)[0],
                   "vocab_positions_with_residual": limits.vocab_positions(info.vocab_size, True)[0]},
    }


@router.post("/v1/completions")
async def create_completion(request: Request):
    """OpenAI legacy completions with log probabilities of generated tokens (`logprobs`), of the
    prompt (`echo` with `logprobs`, `prompt_logprobs`), and `usage` counting the BOS token."""
    limits = request.app.state.limits
    body = await read_json(request)
    req = cmpl.parse_completion(body, limits)
    backend = resolve_model(request, req.model)
    prompts = await run_in_threadpool(cmpl.tokenize_prompts, backend, req)  # long texts: off the event loop
    cmpl.check_caps(backend, req, prompts, limits)
    requests, echoes = cmpl.build_requests(backend, req, prompts, request.state.request_id)
    if req.stream:
        format_deltas, final_chunks = cmpl.stream_formatters(backend, req, requests, echoes)
        hold = await admit(request, requests)
        return stream_held(request, backend, requests, hold, req.params.logprobs or 0, format_deltas, final_chunks)
    hold, outputs = await run_held(request, backend, requests)
    payload, parts = cmpl.format_response(backend, req, requests, outputs, echoes)
    return with_headers(await body_response(payload, parts, req.params.prompt_logprobs == -1, outputs),
                        hold.headers)


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
        return _json(payload)
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


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request):
    """OpenAI chat completions over the model's chat template, with `logprobs` / `top_logprobs`, streaming,
    and `prompt_logprobs` over the templated prompt."""
    limits = request.app.state.limits
    body = await read_json(request)
    req = chat.parse_chat(body, limits)
    backend = resolve_model(request, req.model)
    ids = await run_in_threadpool(chat.render_prompt, backend, req)
    chat.check_caps(backend, req, ids, limits)
    gen_request = chat.build_request(backend, req, ids, request.state.request_id)
    if req.stream:
        format_deltas, final_chunks = chat.stream_formatters(backend, req)
        hold = await admit(request, [gen_request])
        return stream_held(request, backend, [gen_request], hold, req.params.logprobs or 0, format_deltas,
                           final_chunks)
    hold, (output,) = await run_held(request, backend, [gen_request])
    parts = Parts()
    payload = chat.format_response(backend, req, gen_request, output, parts)
    return with_headers(await body_response(payload, parts, req.params.prompt_logprobs == -1, [output]),
                        hold.headers)


@router.post("/v1/score")
async def score(request: Request):
    """The log-likelihood of texts you already have: per-token log probabilities, their sum, mean,
    perplexity and whether each token was the likeliest. No generation."""
    limits = request.app.state.limits
    body = await read_json(request)
    req = scoring.parse_score(body, limits)
    backend = resolve_model(request, req.model)
    items = await run_in_threadpool(scoring.tokenize_items, backend, req)
    scoring.check_caps(backend, req, items, limits)
    requests = scoring.build_requests(backend, req, items, request.state.request_id)
    hold, outputs = await run_held(request, backend, requests)
    return with_headers(_json(scoring.format_response(backend, req, items, outputs)), hold.headers)


@router.post("/v1/compare")
async def compare(request: Request):
    """Two served models that share a tokenizer, on the same tokens: at each position KL(p||q), KL(q||p)
    and Jensen-Shannon divergence (nats) of their next-token distributions, each one's likeliest token
    and whether they agree, and each one's log probability of the actual token. No generation."""
    limits = request.app.state.limits
    req = comparing.parse_compare(await read_json(request))
    pair = comparing.resolve_pair(req, lambda name: resolve_model(request, name))
    comparing.check_same_vocabulary(*pair)
    item = await run_in_threadpool(comparing.tokenize_item, pair, req)
    comparing.check_caps(pair, item, limits)
    requests = comparing.build_requests(pair, item, request.state.request_id)
    hold, results = await run_held_jobs(request, [(backend, [r]) for backend, r in zip(pair, requests)])
    outputs = [outputs[0] for outputs in results]
    try:  # two [P, V] rows compared in float64: off the event loop
        payload = await run_in_threadpool(comparing.format_response, pair, req, item, outputs)
    finally:
        release_arrays(outputs)
    return with_headers(_json(payload), hold.headers)


@router.get("/v1/models")
async def list_models(request: Request):
    """The served models, as an OpenAI model list."""
    return _json({"object": "list", "data": [model_card(b, request.app.state.limits)
                                             for b in request.app.state.backends]})


@router.get("/v1/models/{model:path}")
async def get_model(request: Request, model: str):
    """The model card: aliases, layers, sizes, tokens and the size caps in force."""
    backend = resolve_model(request, model)
    return _json(model_card(backend, request.app.state.limits))


TOKENIZE_FIELDS = {"model", "prompt", "add_special_tokens"}
DETOKENIZE_FIELDS = {"model", "tokens"}


@router.post("/tokenize")
async def tokenize(request: Request):
    """Text -> token ids, with the model's special tokens unless `add_special_tokens` is false."""
    body = await read_json(request)
    v.check_known_fields(body, TOKENIZE_FIELDS, {})
    backend = resolve_model(request, v.get_str(body, "model"), required=False)
    prompt = v.get_str(body, "prompt", required=True)
    add = v.get_bool(body, "add_special_tokens", True)
    ids = await run_in_threadpool(lambda: backend.tokenizer(prompt, add_special_tokens=add).input_ids)
    return _json({"tokens": ids, "count": len(ids), "max_model_len": backend.info.context_length})


@router.post("/detokenize")
async def detokenize(request: Request):
    """Token ids -> text."""
    body = await read_json(request)
    v.check_known_fields(body, DETOKENIZE_FIELDS, {})
    backend = resolve_model(request, v.get_str(body, "model"), required=False)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise v.type_error("tokens", "an array of integers", nullable=False)
    vocab = backend.info.vocab_size
    bad = [t for t in tokens if t < 0 or t >= vocab]
    if bad:
        raise InvalidRequest(f"Invalid value for 'tokens': token id {bad[0]} is outside the vocabulary "
                             f"(0 to {vocab - 1}).", "tokens")
    return _json({"prompt": backend.tokenizer.decode(tokens)})


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request, model: str | None = None):
    """What evaluation harnesses probe: special tokens, vocabulary size, context length (of the model
    named by `?model=`, or the first one)."""
    backend = resolve_model(request, model, required=False)
    info, tok = backend.info, backend.tokenizer
    return _json({
        "model": info.name, "tokenizer_class": type(tok).__name__, "vocab_size": info.vocab_size,
        "bos_token": info.bos_token, "bos_token_id": info.bos_token_id, "eos_token": info.eos_token,
        "eos_token_id": info.eos_token_id, "pad_token": tok.pad_token, "add_bos_token": info.adds_bos,
        "max_model_len": info.context_length, "chat_template": getattr(tok, "chat_template", None),
    })


@router.get("/health")
async def health(request: Request):
    """`ready` (200) when the model is loaded, the engine's last step succeeded and requests are taken;
    `loading`, `draining` or `failing` (503) otherwise, so that a load balancer sends nothing here until
    it is ready, stops when it drains, and stops while the engine's steps fail (`last_error` names the
    exception's class; the engine clears `failing` as soon as a step succeeds, its own self-check
    included)."""
    state = request.app.state
    backend, admission = state.backend, state.admission
    health = combined_stats(state.backends) if backend is not None else {}
    status = ("loading" if backend is None else "draining" if admission.draining
              else "failing" if health["failing"] else "ready")
    body = {"status": status, "requests_running": admission.running, "requests_queued": admission.queue_depth,
            "tokens_held": admission.held, "in_flight": health.get("in_flight", 0),
            "engine_steps": health.get("steps", 0)}
    if "replicas" in health:  # a backend of several replicas (cluster/ray_app.py)
        body["replicas"] = health["replicas"]
    if "models" in health:  # several models in one server
        body["models"] = health["models"]
    if backend is not None:
        body["engine_failures"] = {"steps": health["step_failures"], "requests": health["request_failures"]}
        if "last_error" in health:
            body["last_error"] = health["last_error"]
    return _json(body, 200 if status == "ready" else 503)


def combined_stats(backends: list) -> dict:
    """/health's numbers over the served models: sums, failing when any model's engine is failing, the
    latest error; with several models, each one's own under `models`."""
    each = {b.info.name: b.stats() for b in backends}
    if len(each) == 1:
        return next(iter(each.values()))
    out = {key: sum(s[key] for s in each.values())
           for key in ("in_flight", "steps", "kv_cache_bytes", "step_failures", "request_failures")}
    out["failing"] = any(s["failing"] for s in each.values())
    errors = [s["last_error"] for s in each.values() if "last_error" in s]
    if errors:
        out["last_error"] = max(errors, key=lambda e: e["at"])
    out["models"] = {name: {"status": "failing" if s["failing"] else "ready", "in_flight": s["in_flight"],
                            "engine_steps": s["steps"],
                            "engine_failures": {"steps": s["step_failures"], "requests": s["request_failures"]}}
                     for name, s in each.items()}
    return out


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request):
    """Prometheus text format: requests by path and status, tokens in and out, queue depth, time in
    queue, step time, rows per step, tokens held."""
    body, content_type = request.app.state.metrics.exposition()
    return Response(body, media_type=content_type)
