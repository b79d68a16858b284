"""The API tests' backend without a model: `FakeBackend` (tests/fake_backend.py) on the bundled SmolLM2
tokenizer, with the tiny model's sizes and names, so token strings look real and the answers have the
shapes the real engine's have. Tests that check shapes, refusals and streaming formats use `fake_client`;
tests that compare numbers with the float64 `reference` or with the engine's own answers use `client`."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from fake_backend import FakeBackend
from logprobe.api.app import attach_backends, create_app
from logprobe.config import Limits


@pytest.fixture(scope="session")
def fake_backend(tokenizer):
    return FakeBackend(tokenizer, name="test/tiny-llama", aliases=("tiny",), num_layers=2, d_model=64,
                       context_length=256)


@pytest.fixture(scope="session")
def fake_client(fake_backend):
    app = create_app(fake_backend, Limits())
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="session")
def pair_client(tokenizer):
    """Two fake models on one tokenizer, with different numbers (for /v1/compare): `tiny` (also `base`)
    and `tiny-b` (also `tuned`)."""
    first = FakeBackend(tokenizer, name="test/tiny-llama", aliases=("tiny", "base"), num_layers=2, d_model=64,
                        context_length=256)
    second = FakeBackend(tokenizer, name="test/tiny-llama-b", aliases=("tiny-b", "tuned"), num_layers=2, d_model=64,
                         context_length=256, salt=0x5A17)
    app = create_app(None, Limits())
    attach_backends(app, [first, second])
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c
