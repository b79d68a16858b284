"""HTTP routes. Thin: the POST routes that run a model are registry.py's, each run by pipeline.serve; the
others read the app's state."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from .checks.messages import rendered_ids
from .checks.vocabulary import check_token_ids
from .registry import ROUTES, Route
from .serving.pipeline import serve
from .shell.json_body import json_response, read_json
from .tokenizer.protocol import DetokenizeBody, TokenizeBody

router = APIRouter()
CREATED = int(time.time())


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


def _post_route(route: Route) -> None:
    async def handler(request: Request):
        return await serve(request, route.endpoint)

    handler.__name__ = route.name
    router.add_api_route(route.path, handler, methods=["POST"], name=route.name, description=route.description)


for _route in ROUTES:
    _post_route(_route)


@router.get("/v1/models")
async def list_models(request: Request):
    """The served models, as an OpenAI model list."""
    return json_response({"object": "list", "data": [model_card(b, request.app.state.limits)
                                             for b in request.app.state.backends]})


@router.get("/v1/models/{model:path}")
async def get_model(request: Request, model: str):
    """The model card: aliases, layers, sizes, tokens and the size caps in force."""
    backend = request.app.state.pipeline.resolve_model(model)
    return json_response(model_card(backend, request.app.state.limits))


@router.post("/tokenize")
async def tokenize(request: Request):
    """Text -> token ids, with the model's special tokens unless `add_special_tokens` is false; or a
    conversation -> its chat template's rendering (`prompt`) and the token ids chat sends."""
    limits = request.app.state.limits
    req = TokenizeBody.parse(await read_json(request, limits), limits)
    backend = request.app.state.pipeline.resolve_model(req.model, required=False)
    if req.messages is None:
        special = req.add_special_tokens is not False
        ids = await run_in_threadpool(lambda: backend.tokenizer(req.prompt, add_special_tokens=special).input_ids)
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": backend.info.context_length})
    text, ids = await run_in_threadpool(lambda: rendered_ids(
        backend, req.messages, add_generation_prompt=req.add_generation_prompt is not False,
        add_special_tokens=bool(req.add_special_tokens)))
    return json_response({"tokens": ids, "count": len(ids), "max_model_len": backend.info.context_length,
                          "prompt": text})


@router.post("/detokenize")
async def detokenize(request: Request):
    """Token ids -> text."""
    limits = request.app.state.limits
    req = DetokenizeBody.parse(await read_json(request, limits), limits)
    backend = request.app.state.pipeline.resolve_model(req.model, required=False)
    check_token_ids(req.tokens, backend.info.vocab_size, "tokens")
    return json_response({"prompt": backend.tokenizer.decode(req.tokens)})


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request, model: str | None = None):
    """What evaluation harnesses probe: special tokens, vocabulary size, context length (of the model
    named by `?model=`, or the first one)."""
    backend = request.app.state.pipeline.resolve_model(model, required=False)
    info, tok = backend.info, backend.tokenizer
    return json_response({
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
    return json_response(body, 200 if status == "ready" else 503)


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
