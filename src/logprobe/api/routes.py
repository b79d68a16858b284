"""HTTP routes. Thin: the POST routes that run a model are `Endpoint`s run by pipeline.serve; the
others read the app's state."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from . import chat, comparing, responses, responses_stream, scoring, tree
from . import completions as cmpl
from .json_body import json_response, read_json
from .pipeline import Endpoint, asks_whole_vocab, serve
from .schemas import DetokenizeBody, TokenizeBody
from .vocabulary import check_token_ids

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


COMPLETIONS = Endpoint(cmpl.parse, cmpl.tokenize, cmpl.check_caps, cmpl.build_requests, cmpl.format_response,
                       cmpl.stream_formatters, whole_vocab=asks_whole_vocab)
CHAT = Endpoint(chat.parse, chat.tokenize, chat.check_caps, chat.build_requests, chat.format_response,
                chat.stream_formatters, whole_vocab=asks_whole_vocab)
RESPONSES = Endpoint(responses.parse, responses.tokenize, responses.check_caps, responses.build_requests,
                     responses.format_response, responses_stream.stream_formatters)
SCORE = Endpoint(scoring.parse, scoring.tokenize, scoring.check_caps, scoring.build_requests,
                 scoring.format_response)
COMPARE = Endpoint(comparing.parse, comparing.tokenize, comparing.check_caps, comparing.build_requests,
                   comparing.format_response, resolve=comparing.resolve, jobs=comparing.jobs, format_off_loop=True)
TREE = Endpoint(tree.parse, tree.tokenize, tree.check_caps, tree.build_requests, tree.format_response)


@router.post("/v1/completions")
async def create_completion(request: Request):
    """OpenAI legacy completions with log probabilities of generated tokens (`logprobs`), of the
    prompt (`echo` with `logprobs`, `prompt_logprobs`), and `usage` counting the BOS token."""
    return await serve(request, COMPLETIONS)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request):
    """OpenAI chat completions over the model's chat template, with `logprobs` / `top_logprobs`, streaming,
    and `prompt_logprobs` over the templated prompt."""
    return await serve(request, CHAT)


@router.post("/v1/responses")
async def create_response(request: Request):
    """OpenAI's Responses API over the model's chat template: text or message input, `instructions`,
    `text.format` (structured output), the output tokens' log probabilities with `include:
    ["message.output_text.logprobs"]` and `top_logprobs`, streamed as OpenAI's events. Nothing is stored."""
    return await serve(request, RESPONSES)


@router.post("/v1/score")
async def score(request: Request):
    """The log-likelihood of texts you already have: per-token log probabilities, their sum, mean,
    perplexity and whether each token was the likeliest. No generation."""
    return await serve(request, SCORE)


@router.post("/v1/compare")
async def compare(request: Request):
    """Two served models that share a tokenizer, on the same tokens: at each position KL(p||q), KL(q||p)
    and Jensen-Shannon divergence (nats) of their next-token distributions, each one's likeliest token
    and whether they agree, and each one's log probability of the actual token. With `align: "text"`: two
    or more models of any tokenizers, each one's log probability of every span of the text where all their
    tokenizations have a boundary, the differences, bits per byte and the largest disagreements. No
    generation."""
    return await serve(request, COMPARE)


@router.post("/v1/tree")
async def token_tree(request: Request):
    """The token tree below a prompt: each node's likeliest children to a depth, with every node's raw and
    processed log probability, cumulative log probability, rank and the entropy it was chosen from. The
    prompt runs once and each level of the tree in one pass."""
    return await serve(request, TREE)


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
    text, ids = await run_in_threadpool(lambda: chat.rendered_ids(
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
