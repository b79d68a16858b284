"""`logprobe serve --model A --model B`: one process, two engines, one address. B is the bundled model's
dequantized transformers directory (the same weights by another route), so both must give the same
numbers; each is asked by its own name and alias.

Slow: the server loads the bundled model twice, by two routes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import httpx
import pytest

from logprobe.client import compare

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
    ids = [m["id"] for m in httpx.get(base + "/v1/models", timeout=600).json()["data"]]
    assert ids == ["HuggingFaceTB/SmolLM2-135M-Instruct-Q4_1", Path(smol_dir).name]
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "logprobs": 3, "echo": True}
    answers = {}
    for name in ("gguf", "dir", "smollm2-135m", Path(smol_dir).name):
        r = httpx.post(base + "/v1/completions", json={**body, "model": name}, timeout=60)
        assert r.status_code == 200, r.text
        answers[name] = r.json()["choices"][0]
    assert answers["gguf"] == answers["dir"] == answers["smollm2-135m"] == answers[Path(smol_dir).name]
    assert httpx.post(base + "/v1/completions", json={**body, "model": "nope"}, timeout=600).status_code == 404
    health = httpx.get(base + "/health", timeout=600).json()
    assert health["status"] == "ready" and len(health["models"]) == 2
    assert all(m["engine_steps"] > 0 for m in health["models"].values())
    text = httpx.get(base + "/metrics", timeout=600).text
    assert text.count('logprobe_engine_step_seconds_count{model="') == 2


def test_compare_the_same_weights_by_two_routes(two_models, smol_dir):
    """/v1/compare of the GGUF and its dequantized directory: the same float32 rows, so every divergence
    is exactly 0 and the likeliest tokens agree; the log probabilities are /v1/score's."""
    base = two_models.base
    text = "The capital of France is Paris."
    r = httpx.post(base + "/v1/compare", json={"models": ["gguf", "dir"], "input": text}, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["models"] == ["HuggingFaceTB/SmolLM2-135M-Instruct-Q4_1", Path(smol_dir).name]
    pos, num = out["positions"], len(out["token_ids"])
    assert pos["kl_pq"] == pos["kl_qp"] == pos["js"] == [None] + [0.0] * (num - 1)
    assert pos["top1_agree"] == [None] + [True] * (num - 1)
    assert all(a == b for a, b in pos["logprobs"][1:])
    assert out["summary"]["top1_agreement"] == 1.0 and out["summary"]["mean_js"] == 0.0
    score = httpx.post(base + "/v1/score", json={"model": "gguf", "input": text, "add_bos": False},
                       timeout=600).json()["data"][0]
    assert [lp[0] for lp in pos["logprobs"][1:]] == pytest.approx(score["token_logprobs"][1:], abs=1e-5)
    r = httpx.post(base + "/v1/compare", json={"models": ["gguf", "smollm2-135m"], "input": text}, timeout=600)
    assert r.status_code == 400 and r.json()["error"]["param"] == "models"
    got = compare(base, ["gguf", "dir"], " Paris.", context="The capital of France is")
    assert got.tokens == [" Paris", "."] and got.kl_pq.tolist() == got.js.tolist() == [0.0, 0.0]
    assert (got.top1[:, 0] == got.top1[:, 1]).all() and (got.logprobs[:, 0] == got.logprobs[:, 1]).all()


def test_playground_draws_the_divergence(two_models, smol_dir):
    """With two models served, the Score view offers the second one and draws its divergence per token."""
    import os
    import shutil

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.exists(chromium):
        pytest.skip("Debian's chromium is not installed (the README's test command installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--headless=new", "--no-sandbox", "--disable-gpu"],
                                    timeout=600_000)
        page = browser.new_page()
        page.set_default_timeout(600_000)  # Playwright's 30 s per action is a guess at the machine's speed
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(two_models.base + "/")
        page.wait_for_selector("#score-vs option:nth-child(3)", state="attached")
        assert page.is_visible("#score-vs-label")
        page.select_option("#score-vs", Path(smol_dir).name)
        page.fill("#score-text", "The cat sat on the mat.")
        page.click("#score-run")
        page.wait_for_function("document.querySelector('#score-status').textContent.startsWith('Scored')")
        assert page.is_visible("#score-divergence-figure")
        assert page.locator("#score-divergence svg polyline").count() == 2  # KL and Jensen-Shannon
        assert "top-1 agreement 100%" in page.inner_text("#score-totals")
        browser.close()
    assert not errors, errors
