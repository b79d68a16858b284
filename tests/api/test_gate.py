"""API keys, the hold over HTTP, header and JSON-depth caps, the request time-out, /health states,
/metrics and the access log: on the fake backend (`fake_client`), except the time-out and a closed event
loop, which are the engine's (`client`, `tiny_engine`)."""

from __future__ import annotations

import json
import logging
import re
import time

import pytest
from fastapi.testclient import TestClient

from logprobe.api import app as app_module
from logprobe.api.app import create_app
from logprobe.config import AdmissionSettings, Limits
from paused_engine import paused_after

KEYS = ["sk-first-0123456789", "sk-second-abcdef", "sk-third-xyz"]
# greedy: a sampled first token is the end of sequence about one time in 300 with this fake, and the tests below
# count exactly max_tokens completion tokens
BODY = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "logprobs": 2, "temperature": 0}


def envelope(r, status: int, code: str):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error", "request_id"}
    assert body["error"]["code"] == code
    assert re.fullmatch(r"req_[0-9a-f]{32}", body["request_id"])
    assert r.headers["x-request-id"] == body["request_id"]
    return body["error"]


def make_client(engine, limits=None, admission=None, keys=()):
    app = create_app(engine, limits or Limits(), admission or AdmissionSettings(), list(keys))
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture(scope="module")
def keyed(fake_backend):
    with make_client(fake_backend, keys=KEYS) as c:
        yield c


def auth(key):
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("path,method", [("/v1/completions", "post"), ("/v1/models", "get"),
                                         ("/v1/score", "post"), ("/tokenize", "post"), ("/detokenize", "post"),
                                         ("/tokenizer_info", "get"), ("/v1/chat/completions", "post"),
                                         ("/v1/compare", "post")])
def test_every_api_path_needs_a_key(keyed, path, method):
    r = getattr(keyed, method)(path, **({"json": BODY} if method == "post" else {}))
    err = envelope(r, 401, "invalid_api_key")
    assert err["type"] == "invalid_request_error" and "Authorization: Bearer" in err["message"]
    assert r.headers["www-authenticate"] == "Bearer"


def test_wrong_right_and_malformed_keys(keyed):
    err = envelope(keyed.post("/v1/completions", json=BODY, headers=auth("sk-first-0123456780")), 401,
                   "invalid_api_key")
    assert "sk-first" not in err["message"]  # the presented key is never echoed
    envelope(keyed.post("/v1/completions", json=BODY, headers={"Authorization": KEYS[0]}), 401, "invalid_api_key")
    envelope(keyed.post("/v1/completions", json=BODY, headers={"Authorization": "Basic " + KEYS[0]}), 401,
             "invalid_api_key")
    envelope(keyed.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer "}), 401, "invalid_api_key")
    for key in KEYS:
        r = keyed.post("/v1/completions", json=BODY, headers=auth(key))
        assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["tokens"]) == 4


def test_key_in_query_string_is_refused(keyed):
    for name in ("api_key", "key", "access_token"):
        r = keyed.post(f"/v1/completions?{name}={KEYS[0]}", json=BODY, headers=auth(KEYS[0]))
        err = envelope(r, 401, "invalid_api_key")
        assert "query string" in err["message"]


def test_health_metrics_and_playground_stay_open(keyed):
    assert keyed.get("/health").status_code == 200
    assert keyed.get("/metrics").status_code == 200
    assert keyed.get("/").status_code == 200


def test_key_comparison_is_constant_time(keyed, monkeypatch):
    """Every configured key is compared, with equal-length digests, whether the presented key matches
    the first key, the last or none: no early exit and no length leak."""
    calls = []
    real = app_module.hmac.compare_digest

    def spy(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(app_module.hmac, "compare_digest", spy)
    for presented in (KEYS[0], KEYS[2], "x", "y" * 500):
        calls.clear()
        keyed.get("/v1/models", headers=auth(presented))
        assert calls == [(32, 32)] * len(KEYS)


def test_keys_never_reach_the_log(fake_backend, caplog):
    with make_client(fake_backend, keys=KEYS) as c, caplog.at_level(logging.DEBUG):
        c.post("/v1/completions", json=BODY, headers=auth(KEYS[1]))
        c.post("/v1/completions", json=BODY, headers=auth("sk-wrong-secret"))
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "logprobe.access" in {r.name for r in caplog.records}
    for secret in (*KEYS, "sk-wrong-secret"):
        assert secret not in text


def test_access_log_line(fake_backend, caplog):
    with make_client(fake_backend) as c, caplog.at_level(logging.INFO, logger="logprobe.access"):
        r = c.post("/v1/completions", json=BODY)
    lines = [json.loads(rec.getMessage()) for rec in caplog.records if rec.name == "logprobe.access"]
    line = next(x for x in lines if x["path"] == "/v1/completions")
    assert line["request_id"] == r.headers["x-request-id"] and line["status"] == 200
    assert line["prompt_tokens"] == 3 and line["completion_tokens"] == 4
    assert line["held_tokens"] == 7 and line["queue_ms"] >= 0 and line["ms"] > 0 and line["key"] == "anonymous"


def test_header_cap_is_431(fake_client):
    r = fake_client.get("/v1/models", headers={"x-filler": "a" * 9000})
    err = envelope(r, 431, "request_too_large")
    assert "max_header_bytes" in err["message"]


@pytest.mark.parametrize("depth", [65, 200, 5000])
def test_json_depth_cap(fake_client, depth):
    raw = b'{"model": "tiny", "prompt": "a", "user": ' + b"[" * depth + b"]" * depth + b"}"
    err = envelope(fake_client.post("/v1/completions", content=raw, headers={"content-type": "application/json"}),
                   400, "invalid_request")
    assert "max_json_depth" in err["message"]


def test_json_depth_within_cap_and_many_lists_pass(fake_client):
    # 256 prompts of token ids: 257 brackets, but only 2 levels deep
    r = fake_client.post("/v1/completions", json={"model": "tiny", "prompt": [[5, 6]] * 256, "max_tokens": 0})
    assert r.status_code == 200 and len(r.json()["choices"]) == 256


def test_hold_headers_budget_and_429(fake_backend):
    adm = AdmissionSettings(tokens_per_minute=40, queue_timeout=5)
    with make_client(fake_backend, admission=adm) as c:
        r = c.post("/v1/completions", json=BODY)  # holds 3 + 4 = 7
        assert r.status_code == 200
        assert r.headers["x-ratelimit-limit-tokens"] == "40"
        assert int(r.headers["x-ratelimit-remaining-tokens"]) == 33
        assert r.headers["x-ratelimit-reset-tokens"].endswith("s")
        r = c.post("/v1/completions", json={**BODY, "max_tokens": 38})  # 41 > 40: can never run
        err = envelope(r, 429, "rate_limit_exceeded")
        assert err["type"] == "rate_limit_error" and "tokens_per_minute" in err["message"]
        assert int(r.headers["retry-after"]) >= 1
        r = c.post("/v1/completions", json={**BODY, "max_tokens": 30})  # 33 needed, ~33 left: fits
        assert r.status_code == 200, r.text
        r = c.post("/v1/completions", json={**BODY, "max_tokens": 30})  # the budget is spent: wait > 5 s
        envelope(r, 429, "rate_limit_exceeded")
        assert int(r.headers["retry-after"]) > 5
        admission = c.app.state.admission
        assert (admission.held, admission.running, admission.queue_depth) == (0, 0, 0)


def test_request_over_the_servers_capacity_is_a_400(fake_backend):
    with make_client(fake_backend, limits=Limits(max_tokens_in_flight=50)) as c:
        err = envelope(c.post("/v1/completions", json={**BODY, "max_tokens": 10, "n": 5}), 400, "invalid_request")
        assert "max_tokens_in_flight" in err["message"] and err["param"] == "max_tokens"
        assert c.post("/v1/completions", json={**BODY, "max_tokens": 10, "n": 3}).status_code == 200


def test_request_timeout(tiny_engine):
    """A request still running when its time-out fires gets a 504 (a stream whose first token went out:
    an error event, then [DONE]); nothing stays held, and the engine drops it. The engine is paused
    after two steps of the request until the answer has come, so the time-out fires mid-run on any
    machine. A stream's status goes out with its first token: on a machine too loaded to pick it within
    the limit, the stream's answer is the 504 itself (documented), which is checked as such."""
    body = {"model": "tiny", "prompt": [5], "max_tokens": 250, "n": 16, "temperature": 1.0, "seed": 1}
    with make_client(tiny_engine, admission=AdmissionSettings(request_timeout=1.0)) as c:
        with paused_after(tiny_engine, steps=2):
            r = c.post("/v1/completions", json=body)
        err = envelope(r, 504, "timeout")
        assert err["type"] == "server_error" and "request_timeout" in err["message"]
        with paused_after(tiny_engine, steps=2):
            r = c.post("/v1/completions", json={**body, "stream": True})
        if r.status_code == 504:  # the time-out came before the first token
            assert envelope(r, 504, "timeout")["type"] == "server_error"
        else:
            assert r.status_code == 200
            events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and '"choices"' in events[0]
            assert json.loads(events[-2])["error"]["code"] == "timeout"
        admission = c.app.state.admission
        assert (admission.held, admission.running) == (0, 0)
    while tiny_engine.num_in_flight:  # the engine drops aborted groups before its next step
        time.sleep(0.01)


def test_health_loading_ready_draining(fake_backend):
    from logprobe.api.app import attach_engine

    app = create_app(None)
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        err = envelope(c.post("/v1/completions", json=BODY), 503, "unavailable")
        assert "loading" in err["message"]
        attach_engine(app, fake_backend)
        assert c.get("/health").json()["status"] == "ready"
        assert c.post("/v1/completions", json=BODY).status_code == 200
        app.state.admission.drain()
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "draining"
        err = envelope(c.post("/v1/completions", json=BODY), 503, "unavailable")
        assert err["type"] == "server_error" and "shutting down" in err["message"]


def test_metrics_label_a_path_by_its_route(fake_backend):
    """The path label is the template of the route a path matched, so every endpoint of the registry has
    its own (/v1/tree among them) and the labels stay few whatever paths clients send."""
    with make_client(fake_backend) as c:
        assert c.post("/v1/tree", json={"model": "tiny", "prompt": [5, 6], "depth": 1, "branches": 2}).status_code == 200
        assert c.get("/v1/models/tiny").status_code == 200
        assert c.get("/v1/models/nothing-here").status_code == 404
        assert c.get("/no/such/path/1").status_code == 404
        assert c.get("/no/such/path/2").status_code == 404
        assert c.get("/v1/tree").status_code == 405  # the route's path, another method
        text = c.get("/metrics").text
    counts = {(path, status): float(n) for path, status, n in
              re.findall(r'^logprobe_requests_total\{path="([^"]*)",status="(\d+)"\} (\S+)$', text, re.M)}
    assert counts[("/v1/tree", "200")] == 1 and counts[("/v1/tree", "405")] == 1
    assert counts[("/v1/models/{model}", "200")] == 1 and counts[("/v1/models/{model}", "404")] == 1
    assert counts[("other", "404")] == 2
    assert not any("/no/such" in path for path, _ in counts)


def test_metrics_exposition(fake_backend):
    with make_client(fake_backend) as c:
        c.post("/v1/completions", json=BODY)
        c.post("/v1/completions", json={**BODY, "n": 0})
        text = c.get("/metrics").text
    def value(name):
        m = re.search(r"^" + re.escape(name) + r" ([0-9.e+]+)$", text, re.M)
        assert m, name
        return float(m.group(1))
    assert value('logprobe_requests_total{path="/v1/completions",status="200"}') == 1
    assert value('logprobe_requests_total{path="/v1/completions",status="400"}') == 1
    assert value("logprobe_prompt_tokens_total") == 3 and value("logprobe_completion_tokens_total") == 4
    assert value("logprobe_tokens_held") == 0 and value("logprobe_queue_depth") == 0
    assert value("logprobe_requests_running") == 0 and value("logprobe_queue_time_seconds_count") == 1
    assert value("logprobe_engine_step_seconds_count") >= 4  # one prefill and three decode steps at least
    assert value("logprobe_engine_batch_rows_count") >= 4
    assert value("logprobe_tokens_capacity") == Limits().max_tokens_in_flight


def test_engine_outlives_a_requester_whose_event_loop_closed(tiny_engine):
    """A client (here a whole TestClient and its event loop) that vanishes mid-stream must not take the
    engine's step loop with it: the next request, from another loop, is served."""
    body = {"model": "tiny", "prompt": [5], "max_tokens": 200, "temperature": 1.0, "seed": 2, "stream": True}
    for _ in range(3):
        with make_client(tiny_engine) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                next(line for line in r.iter_lines() if line.startswith("data: "))
    with make_client(tiny_engine, admission=AdmissionSettings(request_timeout=60)) as c:
        r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["logprobs"]["tokens"]) == 4
