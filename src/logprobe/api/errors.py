"""The one error envelope: `{"error": {message, type, param, code}, "request_id"}`.

Code raises `APIError` (or a subclass); the app's handlers turn it, and anything unexpected, into the
envelope. Internals (exception text, stack traces) never reach a client.
"""

from __future__ import annotations

import secrets

import orjson
from starlette.responses import Response

from ..backend import BackendUnavailable, RequestConflict


def new_request_id() -> str:
    return "req_" + secrets.token_hex(16)


class APIError(Exception):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None, *, status: int | None = None,
                 code: str | None = None, type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code
        if type is not None:
            self.type = type
        self.headers = headers or {}


class InvalidRequest(APIError):
    pass


class ContextLengthExceeded(APIError):
    code = "context_length_exceeded"


class ModelNotFound(APIError):
    status = 404
    code = "model_not_found"

    def __init__(self, model: str, param: str = "model"):
        super().__init__(f"The model `{model}` does not exist.", param)


class InvalidAPIKey(APIError):
    status = 401
    code = "invalid_api_key"

    def __init__(self, message: str):
        super().__init__(message, None, headers={"www-authenticate": "Bearer"})


class Timeout(APIError):
    status = 504
    type = "server_error"
    code = "timeout"


class RequestTooLarge(APIError):
    status = 413
    code = "request_too_large"


class InternalError(APIError):
    status = 500
    type = "server_error"
    code = "internal_error"


class Unavailable(APIError):
    status = 503
    type = "server_error"
    code = "unavailable"


class BackendLost(Unavailable):
    """503 `unavailable`: the backend lost the request (its replica died); nothing is charged for it."""


def timed_out(timeout: float) -> Timeout:
    """The 504 of a request that ran past the request time-out, streamed or not."""
    return Timeout(f"The request ran longer than this server's limit of {timeout:g} s (request_timeout) and "
                   "was stopped.")


def backend_error(exc: BaseException) -> APIError | None:
    """The envelope's error for what a backend raised, streamed or not: a request whose own fields leave
    nothing to generate (RequestConflict) is its 400; a lost replica (BackendUnavailable) a 503; None for
    anything else (a server fault: a 500 without internals, and logged)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestConflict):
        return InvalidRequest(exc.message, exc.param)
    if isinstance(exc, BackendUnavailable):
        return BackendLost(str(exc) or "The model replica serving this request went away; try again.")
    return None


def error_body(message: str, type: str, param: str | None, code: str, request_id: str) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": type, "param": param, "code": code}, "request_id": request_id}
    )


def error_response(exc: APIError, request_id: str) -> Response:
    headers = {"x-request-id": request_id, **exc.headers}
    return Response(
        error_body(exc.message, exc.type, exc.param, exc.code, request_id),
        status_code=exc.status,
        media_type="application/json",
        headers=headers,
    )
