"""`logprobe score` (in-process and --url), its chart, and the logprobe.client helpers, on the bundled
model; the printed numbers are checked against a float64 forward of the same weights.

Slow: `logprobe score` runs in processes of its own, each loading the model."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest

from logprobe.client import residual_stream, score

pytestmark = pytest.mark.e2e
TEXT = "The cat sat on the mat."
BOS = 1  # SmolLM2's declared BOS, <|im_start|>


def run_cli(*args):
    out = subprocess.run([sys.executable, "-m", "logprobe.cli", "score", *args], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_cli_table_and_plot(tmp_path, ref64, server):
    png = tmp_path / "chart.png"
    out = run_cli(TEXT, "--plot", str(png))
    rows = re.findall(r"^\s*(\d+)\s+(.+?)\s+(-?\d+\.\d{4})\s+(\d+\.\d{4})\s+(\d+\.\d{2})\s+(\d+)$", out, flags=re.M)
    ids = json.loads(run_cli(TEXT, "--json", "--url", server))["data"][0]["token_ids"]
    assert len(rows) == len(ids) == 7
    ref = ref64([BOS] + ids)
    for (i, _tok, lp, prob, bits, rank), t in zip(rows, ids):
        want = ref[int(i)][t]
        assert abs(float(lp) - want) < 1e-3
        assert abs(float(prob) - math.exp(want)) < 1e-3
        assert abs(float(bits) + want / math.log(2)) < 1e-2
        assert int(rank) == int((ref[int(i)] > want).sum()) + 1
    total = re.search(r"sum logprob (-?\d+\.\d+)\s+mean (-?\d+\.\d+)\s+perplexity (\d+\.\d+)\s+tokens (\d+)", out)
    want_sum = sum(ref[i][t] for i, t in enumerate(ids))
    assert abs(float(total.group(1)) - want_sum) < 1e-3 and int(total.group(4)) == 7
    assert abs(float(total.group(3)) - math.exp(-want_sum / 7)) / math.exp(-want_sum / 7) < 1e-3
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    import matplotlib.image

    assert matplotlib.image.imread(str(png)).shape[0] >= 400


def test_cli_json_has_the_api_shape(server):
    data = json.loads(run_cli(TEXT, "--json", "--url", server, "--top", "2"))
    assert data["object"] == "list" and set(data["data"][0]) >= {
        "index", "tokens", "token_ids", "token_logprobs", "text_offset", "top_logprobs", "logprob", "mean_logprob",
        "perplexity", "num_tokens", "is_greedy"}


def test_client_score_and_residual_stream(server, ref64, smol_dir):
    got = score(server, "smollm2-135m", [TEXT, "A second text."])
    assert len(got) == 2
    ref = ref64([BOS] + list(got[0].token_ids))
    want = np.array([ref[i][t] for i, t in enumerate(got[0].token_ids)])
    np.testing.assert_allclose(got[0].logprobs, want, atol=2e-4)
    assert abs(got[0].logprob - want.sum()) < 1e-3
    layers = residual_stream(server, "smollm2-135m", TEXT, layers=[0, 12, -1])
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float64).eval()
    with torch.inference_mode():
        hs = model(torch.tensor([[BOS] + list(got[0].token_ids)]), output_hidden_states=True).hidden_states
    assert set(layers) == {0, 12, -1}
    np.testing.assert_allclose(layers[0], hs[0][0, 1:].numpy(), atol=1e-5)
    np.testing.assert_allclose(layers[12], hs[12][0, 1:].numpy(), rtol=1e-3, atol=1e-3)
    assert layers[-1].shape == (7, 576)
