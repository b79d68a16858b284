"""The app factory: routes, the request-id middleware and the error envelope."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import FileResponse, Response
from starlette.staticfiles import StaticFiles

from ..config import Limits
from .errors import APIError, InternalError, error_response, new_request_id
from .routes import ClientGone, router

log = logging.getLogger("logprobe.api")


class RequestIdMiddleware:
    """Gives every request an id (`request.state.request_id`), sets `x-request-id` on every response,
    and turns anything that escapes the handlers into a 500 envelope without internals."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        t0 = time.perf_counter()
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("unhandled error in %s %s (%s)", scope.get("method"), scope.get("path"), request_id)
            if not started:
                resp = error_response(InternalError("The server had an error while processing your request."),
                                      request_id)
                await resp(scope, receive, send_with_id)
        finally:
            log.debug("%s %s %s %.1f ms", request_id, scope.get("method"), scope.get("path"),
                      (time.perf_counter() - t0) * 1000)


def _request_id(request: Request) -> str:
    return getattr(request.state, "request_id", None) or new_request_id()


def create_app(engine, limits: Limits | None = None) -> FastAPI:
    """Build the ASGI app around a started `Engine`."""
    app = FastAPI(title="logprobe", version="0.1.0",
                  description="OpenAI-compatible server for a language model's log probabilities.")
    app.state.engine = engine
    app.state.limits = limits or Limits()
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

    app.add_middleware(RequestIdMiddleware)
    return app


def json_response(payload, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")
