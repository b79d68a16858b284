"""The same numbers whatever the number of torch threads: one process with two threads and a replica with
one (`--cpus-per-replica 1`, the default) must answer with the same bits. A float32 matrix product in
MKL sums in an order that depends on the thread count unless its strict reproducibility mode is on
(`logprobe/__init__.py`), and so does torch's `sum` over a whole vocabulary (the entropy of
`position_stats` is summed in one fixed order instead); the bfloat16 and int4 kernels do not depend on
the threads.

Slow: each case loads the bundled model in two processes (one thread, two) and generates."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

WORKER = r"""
import asyncio, json, sys
import logprobe  # first, as every logprobe process does: it sets MKL's mode before torch loads
import torch
from logprobe.backend import GenerationRequest, SamplingParams
from logprobe.engine.runners import loader
from logprobe.engine.engine import Engine

dtype, quantization = sys.argv[1], sys.argv[2]
source = loader.resolve_source(None)
model, tok = loader.load(source, dtype=dtype, quantization=quantization)
engine = Engine(model, tok, source.name, source.aliases)
engine.start()
prompts = ["The capital of France is", "Once upon a time, in a small village", "def fibonacci(n):",
           "The three laws of thermodynamics"]
text = ("The history of the printing press begins in the fifteenth century, when movable metal type, "
        "oil-based inks and a screw press were combined into one system. ") * 3
requests = [GenerationRequest(f"g{i}", tok(p).input_ids, SamplingParams(max_tokens=24, temperature=0, logprobs=5))
            for i, p in enumerate(prompts)]
requests.append(GenerationRequest("i", tok(prompts[0]).input_ids, SamplingParams(
    max_tokens=4, temperature=0.8, seed=3, logprobs=2, position_stats=True, top_logprobs_p=0.9,
    logprob_token_ids=(330, 389), logprobs_mode="both")))  # instruments: sums over the whole vocabulary
requests.append(GenerationRequest("s", tok(text).input_ids, SamplingParams(max_tokens=0, prompt_logprobs=5)))
outputs = asyncio.run(engine.run(requests))
engine.stop()
answer = {"threads": torch.get_num_threads(), "generated": [], "prompt": None}
for out in outputs[:-2]:
    seq = out.choices[0]
    answer["generated"].append({"ids": [int(t) for t in seq.token_ids],
                                "logprobs": [float(x).hex() for x in seq.logprobs],
                                "top": [[float(x).hex() for x in row] for row in seq.top_logprobs]})
extras = outputs[-2].choices[0].extras
answer["instruments"] = {name: [float(x).hex() for x in getattr(extras, name).ravel()]
                         for name in ("entropy", "top_p_mass", "token_id_logprobs", "token_id_logprobs_processed")}
answer["instruments"]["processed"] = [float(x).hex() for x in outputs[-2].choices[0].processed_logprobs]
pc = outputs[-1].prompt_columns
answer["prompt"] = [float(x).hex() for x in pc.logprobs[1:]]
print(json.dumps(answer))
"""


def answer_with(threads: int, dtype: str, quantization: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_CBWR", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["OMP_NUM_THREADS"] = str(threads)
    done = subprocess.run([sys.executable, "-c", WORKER, dtype, quantization], env=env, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["threads"] == threads
    return answer


@pytest.mark.parametrize("dtype,quantization", [("float32", "none"), ("bfloat16", "int4")])
def test_one_thread_and_two_give_the_same_bits(smol_dir, dtype, quantization):
    one, two = answer_with(1, dtype, quantization), answer_with(2, dtype, quantization)
    assert one["generated"] == two["generated"]
    assert one["prompt"] == two["prompt"]
    assert one["instruments"] == two["instruments"]
