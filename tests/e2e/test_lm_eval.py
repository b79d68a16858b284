"""lm-evaluation-harness's `local-completions` model against logprobe, unchanged: its loglikelihood
payload (token-id prompts, echo, logprobs 1, max_tokens 1), its is_greedy check and its remote tokenizer
probe. A small multiple-choice task from a local JSONL file must give the same per-sample
log-likelihoods (within 1e-4) and the same accuracy as lm-eval's own `hf` model on the same weights.

Slow: lm-evaluation-harness runs a task through the server and on its own hf model."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
HERE = Path(__file__).parent / "lmeval"
TASK = """task: logprobe_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def run_eval(model: str, model_args: dict, include: Path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(model=model, model_args=model_args, tasks=["logprobe_mc"], batch_size=4,
                          task_manager=TaskManager(include_path=str(include)), log_samples=True,
                          random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    samples = sorted(out["samples"]["logprobe_mc"], key=lambda s: s["doc_id"])
    lls = [[r[0][0] for r in s["resps"]] for s in samples]
    greedy = [[bool(r[0][1]) for r in s["resps"]] for s in samples]
    return out["results"]["logprobe_mc"]["acc,none"], lls, greedy


def test_lm_eval_local_completions_matches_hf(server, smol_dir, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "task.yaml").write_text(TASK.format(data=HERE / "mc.jsonl"))
    acc_api, lls_api, greedy_api = run_eval("local-completions", {
        "base_url": server + "/v1/completions", "model": "smollm2-135m", "tokenizer_backend": "remote",
        "tokenized_requests": True, "num_concurrent": 2, "max_retries": 1}, tmp_path)
    acc_hf, lls_hf, greedy_hf = run_eval("hf", {"pretrained": str(smol_dir), "dtype": "float32",
                                                 "device": "cpu"}, tmp_path)
    assert len(lls_api) == len(lls_hf) == 12
    for a, b in zip(lls_api, lls_hf):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert abs(x - y) < 1e-4, (x, y)
    assert greedy_api == greedy_hf
    assert acc_api == acc_hf
    assert acc_api > 0.5  # the bundled model knows most of these
    worst = max(abs(x - y) for a, b in zip(lls_api, lls_hf) for x, y in zip(a, b))
    print(f"lm-eval logprobe_mc: acc {acc_api:.3f} (hf {acc_hf:.3f}), max |loglik diff| {worst:.2e}")
