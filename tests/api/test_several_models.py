"""Several models in one server: each request runs on the model it names, /v1/models lists them all,
the hold counts every model's requests against one capacity, /health and /metrics show each."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from fastapi.testclient import TestClient

from logprobe.api.app import attach_backends, create_app
from logprobe.config import AdmissionSettings, Limits
from fake_backend import FakeBackend


@pytest.fixture
def two(tokenizer):
    a = FakeBackend(tokenizer, name="lab/model-a", aliases=("a",), num_layers=2, d_model=64, context_length=256)
    b = FakeBackend(tokenizer, name="lab/model-b", aliases=("b", "bee"), num_layers=3, d_model=32,
                    context_length=128, step_delay=0.05)
    return a, b


def app_of(backends, capacity: int = 300, **admission):
    app = create_app(None, Limits(max_tokens_in_flight=capacity), AdmissionSettings(**admission))
    attach_backends(app, list(backends))
    return app


def test_each_request_runs_on_the_model_it_names(two):
    a, b = two
    with TestClient(app_of(two)) as c:
        listed = c.get("/v1/models").json()["data"]
        assert [m["id"] for m in listed] == ["lab/model-a", "lab/model-b"]
        assert [m["aliases"] for m in listed] == [["a"], ["b", "bee"]]
        assert (listed[1]["num_layers"], listed[1]["context_length"]) == (3, 128)
        assert c.get("/v1/models/bee").json()["id"] == "lab/model-b"
        body = {"prompt": "The sky", "max_tokens": 3, "temperature": 0, "logprobs": 1}
        for name, backend, other in [("a", a, b), ("lab/model-b", b, a), ("bee", b, a)]:
            calls, others = len(backend.calls), len(other.calls)
            r = c.post("/v1/completions", json={**body, "model": name})
            assert r.status_code == 200 and r.json()["model"] == backend.info.name
            assert (len(backend.calls), len(other.calls)) == (calls + 1, others)
        # each model's own checks: b's context is 128 tokens
        r = c.post("/v1/completions", json={**body, "model": "b", "max_tokens": 200})
        assert r.status_code == 400 and "maximum context length is 128" in r.json()["error"]["message"]
        assert c.post("/v1/completions", json={**body, "model": "a", "max_tokens": 200}).status_code == 200
        r = c.post("/v1/completions", json={**body, "model": "c"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        # where `model` is optional the first model answers; /tokenizer_info takes ?model=
        assert c.post("/tokenize", json={"prompt": "hi"}).json()["max_model_len"] == 256
        assert c.post("/tokenize", json={"prompt": "hi", "model": "b"}).json()["max_model_len"] == 128
        assert c.get("/tokenizer_info").json()["model"] == "lab/model-a"
        assert c.get("/tokenizer_info?model=bee").json()["max_model_len"] == 128


def test_one_hold_for_every_model(two):
    """Capacity 120 tokens: a request on b holding 102 (100 steps of 50 ms) leaves no room for one of 39
    on a, which waits in the queue and times out (429) while b's runs; afterwards a's fits."""
    async def main():
        app = app_of(two, capacity=120, queue_timeout=0.3)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            big = asyncio.create_task(c.post("/v1/completions", json={"model": "b", "prompt": "The sky",
                                                                      "max_tokens": 100, "temperature": 0}))
            for _ in range(100):  # until b's request holds its tokens (bounded: 5 s)
                await asyncio.sleep(0.05)
                health = (await c.get("/health")).json()
                if health["tokens_held"]:
                    break
            small = await c.post("/v1/completions", json={"model": "a", "prompt": "Hi " * 30, "max_tokens": 8})
            big = await big
            after = await c.post("/v1/completions", json={"model": "a", "prompt": "Hi " * 30, "max_tokens": 8})
        return health, small, big, after

    health, small, big, after = asyncio.run(main())
    assert health["tokens_held"] == 102 and health["requests_running"] == 1
    assert small.status_code == 429 and "waited" in small.json()["error"]["message"]
    assert big.status_code == 200 and after.status_code == 200


def test_health_and_metrics_show_each_model(two):
    a, b = two
    with TestClient(app_of(two)) as c:
        for name in ("a", "b", "b"):
            assert c.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 2}).status_code == 200
        health = c.get("/health").json()
        assert health["status"] == "ready" and set(health["models"]) == {"lab/model-a", "lab/model-b"}
        assert health["models"]["lab/model-b"]["engine_steps"] == b.stats()["steps"] > 0
        assert health["engine_steps"] == a.stats()["steps"] + b.stats()["steps"]
        text = c.get("/metrics").text
        counts = dict(re.findall(r'^logprobe_engine_step_seconds_count\{model="([^"]+)"\} (\S+)$', text, re.M))
        assert set(counts) == {"lab/model-a", "lab/model-b"}
        assert float(counts["lab/model-b"]) == b.stats()["steps"]
        b.failing = True
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "failing"
        assert r.json()["models"]["lab/model-b"]["status"] == "failing"
        assert r.json()["models"]["lab/model-a"]["status"] == "ready"
