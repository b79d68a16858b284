"""`logprobe serve --model A --model B`: one process, two engines, one address. B is the bundled model's
dequantized transformers directory (the same weights by another route), so both must give the same
numbers; each is asked by its own name and alias."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.e2e

_spec = importlib.util.spec_from_file_location("logprobe_servers", Path(__file__).parents[2] / "benchmarks" / "servers.py")
servers = importlib.util.module_from_spec(_spec)
sys.modules["logprobe_servers"] = servers
_spec.loader.exec_module(servers)


@pytest.fixture(scope="module")
def two_models(smol_dir):
    server = servers.start(["--model", "smollm2-135m", "--alias", "gguf", "--model", str(smol_dir), "--alias", "dir"],
                           prefix="logprobe-two-")
    yield server
    assert server.terminate() == 0


def test_two_models_one_address(two_models, smol_dir):
    base = two_models.base
    ids = [m["id"] for m in httpx.get(base + "/v1/models").json()["data"]]
    assert ids == ["HuggingFaceTB/SmolLM2-135M-Instruct-Q4_1", Path(smol_dir).name]
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "logprobs": 3, "echo": True}
    answers = {}
    for name in ("gguf", "dir", "smollm2-135m", Path(smol_dir).name):
        r = httpx.post(base + "/v1/completions", json={**body, "model": name}, timeout=60)
        assert r.status_code == 200, r.text
        answers[name] = r.json()["choices"][0]
    assert answers["gguf"] == answers["dir"] == answers["smollm2-135m"] == answers[Path(smol_dir).name]
    assert httpx.post(base + "/v1/completions", json={**body, "model": "nope"}).status_code == 404
    health = httpx.get(base + "/health").json()
    assert health["status"] == "ready" and len(health["models"]) == 2
    assert all(m["engine_steps"] > 0 for m in health["models"].values())
    text = httpx.get(base + "/metrics").text
    assert text.count('logprobe_engine_step_seconds_count{model="') == 2
