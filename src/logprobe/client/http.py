"""The one HTTP client of a logprobe server's `/v1/score`, used by `logprobe.client.score`, `logprobe score
TEXT --url` and the dataset job's remote scorer (datasets/remote.py).

Requests go to the servers in turn. 429, 5xx and a dropped connection are tried again with exponential
backoff, waiting at least what Retry-After says, up to `max_attempts`; a refusal a retry cannot fix
(400, 401, 403, 404, 405, 413, 422) raises at once with the server's message. A connection refused before
any server has answered raises at once too, naming the address: nothing listens there, and waiting would
not change that. Without a model name, the server's first model is asked for (GET /v1/models).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import threading

import httpx

RETRIED = {429, 500, 502, 503, 504}


class ServerError(RuntimeError):
    """A request that got no answer: refused (`status`: the HTTP status; None when nothing answered) or
    given up after its attempts (`gave_up`)."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None, gave_up: bool = False):
        super().__init__(message)
        self.message, self.status, self.code, self.gave_up = message, status, code, gave_up


def run_sync(coro):
    """Run a coroutine to the end from synchronous code, also where an event loop already runs
    (Jupyter): then in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box = {}

    def target():
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="logprobe-client")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class ScoreClient:
    """`async with ScoreClient(urls) as client: await client.score({"input": ...})`. `timeout`: httpx's
    (by default no overall deadline: a long request on a loaded server may take minutes; connecting
    may not); `transport`: httpx's (tests)."""

    def __init__(self, urls: list[str] | str, api_key: str | None = None, model: str | None = None,
                 max_attempts: int = 8, timeout=None, transport=None):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("no server URL given")
        self.urls = [u.rstrip("/") for u in urls]
        self.model = model
        self.max_attempts = max(1, max_attempts)
        self.answered = False  # whether any server has answered yet
        self._next_url = itertools.cycle(range(len(self.urls)))
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=60.0) if timeout is None else timeout,
                                       headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
                                       transport=transport)

    async def __aenter__(self) -> "ScoreClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self._http.aclose()

    async def model_name(self) -> str:
        """The model asked for, or the server's first one."""
        if self.model is None:
            self.model = (await self.request("GET", "/v1/models"))["data"][0]["id"]
        return self.model

    async def score(self, body: dict) -> dict:
        """POST /v1/score with `body` (its `model` filled in when it has none)."""
        if "model" not in body:
            body = {"model": await self.model_name(), **body}
        return await self.request("POST", "/v1/score", body)

    async def request(self, method: str, path: str, body: dict | None = None) -> dict:
        """The JSON answer of one request, tried again as the module says."""
        for attempt in range(1, self.max_attempts + 1):
            base = self.urls[next(self._next_url)]
            url = base + path
            wait = min(30.0, 0.5 * 2 ** attempt) * (0.5 + random.random() / 2)
            try:
                r = await self._http.request(method, url, json=body)
            except httpx.ConnectError as exc:
                if not self.answered:
                    raise ServerError(f"cannot connect to {base} ({exc or type(exc).__name__}): is a logprobe "
                                      "server running at that address?") from None
                problem = f"{url}: {type(exc).__name__}: {exc}"
            except httpx.TransportError as exc:
                problem = f"{url}: {type(exc).__name__}: {exc}"
            else:
                self.answered = True
                if r.status_code == 200:
                    return r.json()
                message, code = error_of(r)
                problem = f"{url} answered {r.status_code}: {message}"
                if r.status_code not in RETRIED:
                    raise ServerError(f"the server refused: {problem}", r.status_code, code)
                wait = max(wait, retry_after(r))
            if attempt == self.max_attempts:
                raise ServerError(f"gave up after {attempt} attempts: {problem}", gave_up=True)
            await self.back_off(wait)
        raise AssertionError("unreachable")

    async def back_off(self, seconds: float) -> None:
        """The wait before a request's next attempt (tests record it instead)."""
        await asyncio.sleep(seconds)


def error_of(response) -> tuple[str, str | None]:
    """The message and code of an error envelope (or the body's start when it is none)."""
    try:
        error = response.json()["error"]
        return str(error.get("message", error)), error.get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return response.text[:300], None


def retry_after(response) -> float:
    try:
        return min(300.0, max(0.0, float(response.headers.get("retry-after", "0"))))
    except ValueError:
        return 1.0
