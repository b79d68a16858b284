"""One real `logprobe serve` process on the bundled model for every end-to-end test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
import torch

MODEL = "smollm2-135m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server(smol_dir):
    port = free_port()
    # The log goes to a file: a pipe nobody reads fills up (one access-log line per request) and blocks it.
    log = tempfile.NamedTemporaryFile(prefix="logprobe-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "logprobe.cli", "serve", "--port", str(port),
                             "--alias", "smol"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited:\n" + open(log.name, errors="replace").read())
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)
    else:
        proc.kill()
        raise RuntimeError("server did not start")
    yield base
    proc.terminate()
    proc.wait(timeout=20)


@pytest.fixture(scope="session")
def oai(server):
    from openai import OpenAI

    return OpenAI(base_url=server + "/v1", api_key="unused")


@pytest.fixture(scope="session")
def ref64(smol_dir):
    """The same dequantized weights in float64, run without a cache."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float64).eval()

    @torch.inference_mode()
    def logprobs(ids):
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()

    return logprobs


