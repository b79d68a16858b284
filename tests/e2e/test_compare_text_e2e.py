"""`logprobe serve --model smollm2-135m --model gemma3-270m`: the two bundled models, of different
tokenizers, compared on one text (`/v1/compare` with `align: "text"`) through a real server: the spans
against each tokenizer's own decoding, every number against each model's `/v1/score` of the same text
on the same server (itself checked against float64 in test_server.py and test_gemma.py), and the
playground's Compare view showing them.

Slow: one server loads both bundled models (on a fresh machine, after Gemma 3 is dequantized)."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from logprobe.engine.runners import loader

pytestmark = pytest.mark.e2e

try:
    loader.resolve_source("gemma3-270m")
except loader.ModelLoadError as exc:
    pytest.skip(f"Gemma 3 270M is not installed: {exc}", allow_module_level=True)

_spec = importlib.util.spec_from_file_location("logprobe_servers", Path(__file__).parents[2] / "benchmarks" / "servers.py")
servers = importlib.util.module_from_spec(_spec)
sys.modules["logprobe_servers"] = servers
_spec.loader.exec_module(servers)

TIMEOUT_S = 600
TOL = 2e-4  # a log probability computed again (from the prefix cache): float32 rounding over 30 layers
TEXT = "The naïve café owner said: 日本語 is fun 🙂, isn't it?"
NAMES = ["HuggingFaceTB/SmolLM2-135M-Instruct-Q4_1", "google/gemma-3-270m-Q4_K_M"]


@pytest.fixture(scope="module")
def both(gemma_dir):
    server = servers.start(["--model", "smollm2-135m", "--model", "gemma3-270m"], prefix="logprobe-span-compare-")
    yield server.base
    assert server.terminate() == 0


def post(base: str, path: str, body: dict) -> dict:
    r = httpx.post(base + path, json=body, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_two_bundled_models_on_one_text(both):
    out = post(both, "/v1/compare", {"models": ["smollm2-135m", "gemma3-270m"], "input": TEXT, "align": "text"})
    assert out["models"] == NAMES
    scores = [post(both, "/v1/score", {"model": m, "input": TEXT})["data"][0] for m in ("smollm2-135m", "gemma3-270m")]
    cuts, own = [], []
    for m, score in enumerate(scores):
        got = out["tokenizations"][m]
        assert got["token_ids"] == score["token_ids"]
        # the score call may find the compare's tokens in the prefix cache: equal within float32 rounding
        assert got["token_logprobs"] == pytest.approx(score["token_logprobs"], abs=TOL)
        own.append(got["token_logprobs"])
        # where each token ends, in characters, counted from the tokens' own bytes as /v1/score names them
        ends, data = {0: 0}, b""
        for k, token in enumerate(score["tokens"]):
            data += token_bytes(token)
            try:
                ends.setdefault(len(data.decode("utf-8")), k + 1)
            except UnicodeDecodeError:
                pass  # this token ends inside a character
        assert data == TEXT.encode()
        cuts.append(ends)
        total = math.fsum(own[m])
        assert out["summary"]["logprob"][m] == pytest.approx(total, abs=1e-9)
        assert total == pytest.approx(score["logprob"], abs=TOL * len(own[m]))
        assert out["summary"]["bits_per_byte"][m] == pytest.approx(-total / math.log(2) / len(data), rel=1e-12)
    edges = sorted(set(cuts[0]) & set(cuts[1]))
    assert out["spans"]["text"] == [TEXT[a:b] for a, b in zip(edges[:-1], edges[1:])]
    for s, (a, b) in enumerate(zip(edges[:-1], edges[1:])):
        want = [math.fsum(own[m][cuts[m][a]:cuts[m][b]]) for m in range(2)]
        assert out["spans"]["logprobs"][s] == pytest.approx(want, abs=1e-9)
        assert out["spans"]["difference"][s][0] == pytest.approx(want[1] - want[0], abs=1e-9)
    spread = out["spans"]["spread"]
    assert out["disagreements"] == sorted(range(len(spread)), key=lambda i: (-spread[i], i))[:10]
    # SmolLM2 cuts 日本語 into byte pieces; no span ends inside a character
    assert any(t.startswith("bytes:") for t in scores[0]["tokens"]) and "日本語" in "".join(out["spans"]["text"])


def token_bytes(token: str) -> bytes:
    """A token's bytes from the API's name for it (`bytes:\\xe6\\x97` for a piece of a character)."""
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in token[len("bytes:"):].split("\\x")[1:])
    return token.encode("utf-8")


def test_client_columns(both):
    from logprobe.client import compare_spans

    got = compare_spans(both, ["gemma3-270m", "smollm2-135m"], " is fun", context="日本語")
    out = post(both, "/v1/compare", {"models": ["gemma3-270m", "smollm2-135m"], "input": " is fun",
                                     "context": "日本語", "align": "text"})
    assert got.models == NAMES[::-1] and "".join(got.spans) == " is fun"
    assert got.logprobs.shape == (len(got.spans), 2) and got.difference.shape == (len(got.spans), 1)
    np.testing.assert_allclose(got.logprobs, out["spans"]["logprobs"], atol=TOL * 4)  # the cache, float32 rounding
    np.testing.assert_allclose(got.difference[:, 0], got.logprobs[:, 1] - got.logprobs[:, 0], atol=1e-9)
    assert got.bits_per_byte.shape == (2,) and np.all(got.bits_per_byte > 0)


def test_refused_with_one_tokenizer_mode(both):
    r = httpx.post(both + "/v1/compare", json={"models": ["smollm2-135m", "gemma3-270m"], "input": TEXT},
                   timeout=TIMEOUT_S)
    assert r.status_code == 400 and "send 'align': 'text'" in r.json()["error"]["message"]


def test_playground_shows_the_models_on_one_text(both, tmp_path):
    from test_playground import ARGS, CHROMIUM, READY, WAIT_MS, new_page, shot  # the playground tests' helpers

    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (the README's test command installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, timeout=WAIT_MS)
        ctx, page, errors = new_page(browser, {"width": 1280, "height": 900})
        page.goto(both + "/")
        page.wait_for_function(READY)
        page.click("#tab-compare")
        assert page.locator("#models-pick input:checked").count() == 2
        text = page.locator("#models-text").input_value()
        page.click("#models-run")
        page.wait_for_selector("#models-table tbody tr")
        api = post(both, "/v1/compare", {"models": NAMES, "input": text, "align": "text"})
        spans = page.locator("#models-spans .span")
        assert spans.count() == api["summary"]["num_spans"]
        assert "".join(spans.nth(i).inner_text() for i in range(spans.count())) == text
        totals = page.locator("#models-totals").inner_text()
        for bpb in api["summary"]["bits_per_byte"]:
            assert f"{bpb:.3f} bits per byte" in totals
        rows = page.locator("#models-table tbody tr")
        assert rows.count() == len(api["disagreements"])
        first = api["disagreements"][0]
        assert rows.nth(0).get_attribute("data-span") == str(first)
        assert f"{api['spans']['spread'][first]:.3f}" in rows.nth(0).inner_text()
        shot(page, "compare-models.png", tmp_path)
        ctx.close()
        browser.close()
    assert not errors, errors
