"""The GPU check (benchmarks/gpu_check.py), its sections that check numbers run here on the CPU so that
they work when a device is lent (a device's time is scarce: a section broken by a change of the engine's
interfaces would spend it for nothing). The same-bits section (`invariance_runs`): on a tiny Llama it
finds the same bits beside 1 and 15 requests of every kind, and it finds the difference where a
request's numbers move with the rows beside it. The families section: every family's tiny model, in
float32 and bfloat16, against its float64 forward, the shared-prefix scoring pass run on the lean runner."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from logprobe.engine.engine import Engine
from logprobe.engine.runners.lean.attention import Attention
from test_batch_invariance import mixed
from test_families import build


@pytest.fixture(scope="module")
def gpu_check():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("logprobe_gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def engine(tokenizer):
    return Engine(build("llama", len(tokenizer)), tokenizer, "llama-check", [], prefix_cache_mb=0)


@pytest.mark.skipif(not Attention.invariant_kernels(), reason=(
    f"torch {torch.__version__}: its CPU attention gives a decode row other bits than a prompt pass"))
def test_the_same_bits_are_found_where_they_hold(gpu_check, engine):
    with torch.inference_mode():
        out = gpu_check.invariance_runs(engine, (1, 15), mixed, seed=17)
    assert out["passed"], out
    assert [k for k in out if k.startswith("beside_")] == ["beside_1", "beside_15"]
    assert all(out[k]["differ"] == [] and out[k]["max_abs_difference"] == 0.0 for k in ("beside_1", "beside_15"))


def test_a_number_that_moves_with_the_rows_beside_it_is_found(gpu_check, engine, monkeypatch):
    """The head's log probabilities shifted by 1e-6 per row of its call: the generations, whose decode
    steps share the head's call with the others' rows, are named as differing, and the difference found
    is of the shift's size (not a wrong comparison of unrelated arrays)."""
    plain = engine.runner.logprobs_of
    monkeypatch.setattr(engine.runner, "logprobs_of",
                        lambda hidden: plain(hidden) + 1e-6 * hidden.reshape(-1, hidden.shape[-1]).shape[0])
    with torch.inference_mode():
        out = gpu_check.invariance_runs(engine, (15,), mixed, seed=17)
    beside = out["beside_15"]
    assert not out["passed"] and not beside["same_bits"]
    assert {"greedy", "sampled"} <= set(beside["differ"])
    assert 0 < beside["max_abs_difference"] < 1e-3


def test_the_families_section_runs_and_passes(gpu_check, tokenizer):
    out = gpu_check.families(torch.device("cpu"), tokenizer)
    assert out["passed"], out
    assert not [name for name, v in out.items() if name != "passed" and "error" in v]
    assert all(v["shared_prefix_ran"] for name, v in out.items() if name != "passed" and v["runner"] == "lean")
    assert max(v["max_abs_error"] for name, v in out.items() if name.endswith("float32")) < 1e-4
