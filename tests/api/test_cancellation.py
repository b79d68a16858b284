"""A request whose handler is cancelled (the server shutting down, a batch line stopped) ends as a
cancellation, wherever it was: waiting for its hold, running, or streaming; with no request time-out
(`--request-timeout 0`) and with one. The cancellation propagates out of the app, the backend aborts what
ran, the hold is given back and the key charged the tokens generated until then, and the access log has
the request as one that got no answer (499): never as a time-out (504) or an internal error (500)."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from fake_backend import FakeBackend, TinyTokenizer
from logprobe.api.app import create_app
from logprobe.config import AdmissionSettings, Limits


def scope_of(raw: bytes) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5000), "server": ("testserver", 80),
            "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"),
                        (b"content-length", str(len(raw)).encode())]}


async def cancel_when(app, body: dict, ready) -> list[dict]:
    """POST `body` to the app from a client that never leaves, and cancel the handler's task once
    `ready(sent)` holds; the task must end cancelled. Returns the ASGI messages sent."""
    raw = json.dumps(body).encode()
    sent, asked = [], 0

    async def receive():
        nonlocal asked
        asked += 1
        if asked == 1:
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.Event().wait()  # the client stays

    async def send(message):
        sent.append(message)

    task = asyncio.ensure_future(app(scope_of(raw), receive, send))
    while not ready(sent):
        assert not task.done(), (task.result(), sent)
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return sent


def access_lines(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "logprobe.access"]


def assert_nothing_left(backend, app) -> None:
    admission = app.state.admission
    assert backend.stats()["in_flight"] == 0
    assert (admission.held, admission.running, admission.queue_depth) == (0, 0, 0)


def assert_no_error_logged(caplog) -> None:
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


@pytest.fixture(params=[0, 30], ids=["no time-out", "time-out"])
def slow(request):
    """A backend that takes 10 ms a step, and an app around it: without a request time-out, or with one
    long enough never to fire here."""
    backend = FakeBackend(TinyTokenizer(), step_delay=0.01)
    app = create_app(backend, Limits(max_tokens_in_flight=260), AdmissionSettings(request_timeout=request.param))
    return backend, app


def test_cancelled_while_waiting_for_its_hold(slow, caplog):
    backend, app = slow
    admission = app.state.admission

    async def main():
        blocker = await admission.acquire("anonymous", 200)
        with caplog.at_level(logging.INFO):
            sent = await cancel_when(app, {"model": "tiny", "prompt": "x", "max_tokens": 100, "seed": 2},
                                     lambda sent: admission.queue_depth == 1)
        assert sent == []  # no status went out
        admission.release(blocker, used=0)

    asyncio.run(main())
    assert backend.calls == []  # it never ran
    assert_nothing_left(backend, app)
    (line,) = access_lines(caplog)
    assert line["status"] == 499 and "prompt_tokens" not in line
    assert_no_error_logged(caplog)


def test_cancelled_while_running(slow, caplog):
    """Cancelled after its fifth step of 200: aborted in the backend, charged its prompt and the tokens
    generated until then."""
    backend, app = slow

    async def main():
        with caplog.at_level(logging.INFO):
            sent = await cancel_when(app, {"model": "tiny", "prompt": "x", "max_tokens": 200, "seed": 1},
                                     lambda sent: backend.num_steps >= 5)
        assert sent == []

    asyncio.run(main())
    assert backend.cancelled == [[backend.calls[0].requests[0].request_id]]
    assert_nothing_left(backend, app)
    (line,) = access_lines(caplog)
    assert line["status"] == 499 and line["prompt_tokens"] == 2
    assert 3 <= line["completion_tokens"] < 200, line
    assert_no_error_logged(caplog)
    metrics = app.state.metrics.registry
    assert metrics.get_sample_value("logprobe_completion_tokens_total") == line["completion_tokens"]


def test_cancelled_while_streaming(slow, caplog):
    """Cancelled once its first chunk went out: the backend's stream is closed before its end, the hold
    given back; the status already sent (200) is the one logged."""
    backend, app = slow

    def first_chunk(sent):
        return any(m["type"] == "http.response.body" and m.get("body") for m in sent)

    async def main():
        with caplog.at_level(logging.INFO):
            sent = await cancel_when(app, {"model": "tiny", "prompt": "x", "max_tokens": 200, "seed": 1,
                                           "stream": True}, first_chunk)
        assert sent[0]["status"] == 200

    asyncio.run(main())
    (record,) = backend.streams
    assert record.closed and not record.finished
    assert_nothing_left(backend, app)
    (line,) = access_lines(caplog)
    assert line["status"] == 200 and line["prompt_tokens"] == 2 and 1 <= line["completion_tokens"] < 200, line
    assert_no_error_logged(caplog)
