"""The app factory: routes, the request-id middleware and the error envelope."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import re
import time
from pathlib import Path

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import FileResponse, Response
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles

from ..config import AdmissionSettings, Limits
from .errors import APIError, InternalError, InvalidAPIKey, Unavailable, error_response, new_request_id
from .registry import add_request_bodies
from .routes import router
from .serving.admission import Admission
from .serving.holding import ClientGone, Notes
from .serving.pipeline import Pipeline
from .shell.metrics import Metrics

log = logging.getLogger("logprobe.api")
access_log = logging.getLogger("logprobe.access")


PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info")
OPEN_PATHS = ("/health", "/metrics")
QUERY_KEY_NAMES = {b"api_key", b"api-key", b"apikey", b"key", b"token", b"access_token"}


class KeyRing:
    """The configured API keys, compared in constant time: the presented key and every configured key
    are hashed to equal-length digests, and every key is compared (no early exit on a match), so the
    time taken tells nothing about how much of a key was right or which key matched."""

    def __init__(self, keys):
        self._digests = [(hashlib.sha256(k.encode()).digest(), "key-" + hashlib.sha256(k.encode()).hexdigest()[:8])
                         for k in keys]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def identify(self, presented: bytes) -> str | None:
        """The id of the key (for budgets and logs; never the key itself), or None."""
        digest = hashlib.sha256(presented).digest()
        found = None
        for known, key_id in self._digests:
            if hmac.compare_digest(digest, known):
                found = key_id
        return found


def _is_protected(path: str) -> bool:
    return path.startswith(PROTECTED_PREFIXES) or path == "/v1"


class Gate:
    """The first thing every request meets: its id (`x-request-id` on every response), the header cap,
    the API key, loading/draining, and on the way out the access-log line and the request metrics.
    Anything that escapes the handlers becomes a 500 envelope without internals."""

    def __init__(self, app, state):
        self.app = app
        self.state = state  # the FastAPI app's state: engine, limits, keys, admission, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = new_request_id()
        info = scope.setdefault("state", {})
        info["request_id"] = request_id
        info["key_id"] = "anonymous"
        notes = info["notes"] = Notes()  # the hold and the usage, written as the request runs (holding.py)
        started, status = False, 500

        async def send_with_id(message):
            nonlocal started, status
            if message["type"] == "http.response.start":
                started, status = True, message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        t0 = time.perf_counter()
        path = scope.get("path", "")
        try:
            refusal = self._refusal(scope, info)
            if refusal is not None:
                await error_response(refusal, request_id)(scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("unhandled error in %s %s (%s)", scope.get("method"), path, request_id)
            if not started:
                resp = error_response(InternalError("The server had an error while processing your request."),
                                      request_id)
                await resp(scope, receive, send_with_id)
        finally:
            if not started:
                status = 499  # the client left before an answer began
            self._record(scope, info, notes, path, status, time.perf_counter() - t0)

    def _refusal(self, scope, info) -> APIError | None:
        """Why this request is refused before any handler runs, or None."""
        limits = self.state.limits
        size = sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ()))
        if size > limits.max_header_bytes:
            return APIError(f"The request headers take {size} bytes, over this server's cap of "
                            f"{limits.max_header_bytes} bytes (max_header_bytes).", None, status=431,
                            code="request_too_large")
        path = scope.get("path", "")
        keys: KeyRing = self.state.keys
        if keys and _is_protected(path):
            query = scope.get("query_string", b"")
            if query and any(part.split(b"=", 1)[0].lower() in QUERY_KEY_NAMES for part in query.split(b"&")):
                return InvalidAPIKey("API keys are not accepted in the query string (it ends up in logs and "
                                     "browser history). Send it in the header: Authorization: Bearer KEY.")
            auth = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
            scheme, _, presented = (auth or b"").partition(b" ")
            if auth is None or scheme.lower() != b"bearer" or not presented.strip():
                return InvalidAPIKey("You did not send an API key. Send it in the header: Authorization: Bearer KEY.")
            key_id = keys.identify(presented.strip())
            if key_id is None:
                return InvalidAPIKey("The API key you sent is not valid on this server.")
            info["key_id"] = key_id
        if _is_protected(path):
            if self.state.backend is None:
                return Unavailable("The model is still loading; try again in a moment (GET /health says "
                                   "when it is ready).")
            if self.state.admission.draining:
                return Unavailable("The server is shutting down and takes no new requests.")
        return None

    def _quiet_probe(self, status: int) -> bool:
        """A 503 probe while the model loads is expected (a start polls /health until ready): not logged.
        A 503 that says the engine is failing or draining is."""
        return status == 503 and self.state.backend is None

    def _record(self, scope, info, notes: Notes, path: str, status: int, seconds: float) -> None:
        metrics = self.state.metrics
        label = route_label(scope)
        metrics.requests.labels(label, str(status)).inc()
        metrics.request_seconds.labels(label).observe(seconds)
        usage = notes.usage
        if usage is not None:
            metrics.prompt_tokens.inc(usage[0])
            metrics.completion_tokens.inc(usage[1])
        if label in ("/health", "/metrics") and (status == 200 or self._quiet_probe(status)):
            return  # probes would drown the log
        line = {"request_id": info["request_id"], "method": scope.get("method"), "path": path,
                "status": status, "key": info.get("key_id"), "ms": round(seconds * 1000, 1)}
        if usage is not None:
            line["prompt_tokens"], line["completion_tokens"] = usage
        hold = notes.hold
        if hold is not None:
            line["held_tokens"] = hold.tokens
            line["queue_ms"] = round(hold.queue_seconds * 1000, 1)
        access_log.info(orjson.dumps(line).decode())


def route_label(scope) -> str:
    """The metrics' path label: the template of the route the request matched (`/v1/models/{model}`,
    `/v1/files/{file_id}`; the router notes it in the scope, a path of another method too), or `other`
    (no route, the static files), so that the labels stay few whatever paths clients send."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    if isinstance(route, Mount) or not isinstance(path, str):
        return "other"
    return re.sub(r":\w+}", "}", path)  # {model:path} -> {model}


def _request_id(request: Request) -> str:
    return getattr(request.state, "request_id", None) or new_request_id()


def create_app(backend, limits: Limits | None = None, admission: AdmissionSettings | None = None,
               api_keys=(), admission_control=None) -> FastAPI:
    """Build the ASGI app around a backend (backend/: a started `Engine`, or replicas), or around None
    while the model loads (API paths answer 503 until `attach_backend`). `admission_control` replaces the
    one-process hold (api/serving/admission.py) with another of its interface (cluster/state.py). What is
    installed on top of it (the Batch API: server.py) adds its start and stop to `app.state.services`."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        app.state.loop = asyncio.get_running_loop()  # for the SIGTERM drain, which runs in another thread
        started = []
        try:
            for start, stop in list(app.state.services):
                await start(app)
                started.append(stop)
            yield
        finally:
            for stop in reversed(started):
                await stop(app)

    # /docs and /redoc with their scripts and styles served from the fastapi-offline package, not a CDN
    app = FastAPIOffline(title="logprobe", version="0.1.0", lifespan=lifespan,
                         description="OpenAI-compatible server for a language model's log probabilities. "
                                     "`/metrics` (Prometheus text) and the playground `/` are left out of "
                                     "this schema on purpose.")
    build_schema = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = add_request_bodies(build_schema())
        return app.openapi_schema

    app.openapi = openapi
    app.state.backend = None
    app.state.backends = []
    app.state.limits = limits or Limits()
    app.state.settings = admission or AdmissionSettings()
    app.state.keys = KeyRing(api_keys)
    app.state.admission = admission_control or Admission(
        app.state.limits.max_tokens_in_flight, app.state.settings.tokens_per_minute, app.state.settings.max_queue,
        app.state.settings.queue_timeout)
    app.state.metrics = Metrics()
    app.state.admission.on_queue_time = app.state.metrics.queue_seconds.observe
    app.state.metrics.watch(app.state.admission)
    app.state.services = []  # (start(app), stop(app)) pairs the lifespan runs
    app.state.loop = None  # the server's event loop, once the lifespan starts
    # the Batch API's, where batch/runner.py's `install` adds it (None: no Batch API)
    app.state.make_batch_runner = app.state.batch_runner = None
    app.state.pipeline = Pipeline(app.state.limits, app.state.admission,
                                  lambda: app.state.settings.request_timeout or None)
    if backend is not None:
        attach_backend(app, backend)
    app.include_router(router)
    web = Path(__file__).resolve().parent.parent / "web"
    app.mount("/static", StaticFiles(directory=web), name="static")

    @app.get("/", include_in_schema=False)
    async def playground():
        """The playground: a page that shows what the model thought of each token."""
        return FileResponse(web / "index.html", media_type="text/html")

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return error_response(exc, _request_id(request))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 405:
            err = APIError(f"Method {request.method} is not allowed on {request.url.path}.", None,
                           status=405, code="method_not_allowed")
        elif exc.status_code == 404:
            err = APIError(f"Unknown path: {request.method} {request.url.path}.", None, status=404,
                           code="not_found")
        else:
            err = APIError(str(exc.detail), None, status=exc.status_code)
        return error_response(err, _request_id(request))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x not in ("body", "query", "path")]
        return error_response(APIError(f"Invalid request: {first.get('msg', 'bad input')}",
                                       ".".join(loc) or None), _request_id(request))

    @app.exception_handler(ClientGone)
    async def on_client_gone(request: Request, exc: ClientGone):
        # Nobody reads this; 499 (nginx's "client closed request") marks it in the access log.
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception):
        log.exception("internal error (%s)", _request_id(request))
        return error_response(InternalError("The server had an error while processing your request."),
                              _request_id(request))

    app.add_middleware(Gate, state=app.state)
    return app


def attach_backends(app: FastAPI, backends: list) -> None:
    """The models are loaded: serve them (a request picks one by `model`; the first is the default of
    the paths where `model` is optional). In-process engines report their steps and failures to this
    app's metrics as they happen (labelled by model when there are several); a backend of replicas
    brings its own (cluster/ray_app.py)."""
    app.state.metrics.attach_backends(backends)
    app.state.backends = list(backends)
    app.state.backend = backends[0]
    app.state.pipeline.attach(backends)


def attach_backend(app: FastAPI, backend) -> None:
    attach_backends(app, [backend])


attach_engine = attach_backend
