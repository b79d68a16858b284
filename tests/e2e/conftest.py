"""One real `logprobe serve` process on the bundled model for every end-to-end test."""

from __future__ import annotations

import pytest
import serve_process
import torch

MODEL = "smollm2-135m"


@pytest.fixture(scope="session")
def server(smol_dir):
    proc, base = serve_process.start(["--alias", "smol"])
    yield base
    serve_process.stop(proc)


@pytest.fixture(scope="session")
def oai(server):
    from openai import OpenAI

    # A retry would turn a server error into a pass; 600 s leaves a loaded machine time to answer.
    return OpenAI(base_url=server + "/v1", api_key="unused", timeout=600, max_retries=0)


@pytest.fixture(scope="session")
def ref64(smol_dir):
    """The same dequantized weights in float64, run without a cache."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float64).eval()

    @torch.inference_mode()
    def logprobs(ids):
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()

    return logprobs


