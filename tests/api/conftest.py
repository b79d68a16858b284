"""The API tests' backend without a model: `FakeBackend` (tests/fake_backend.py) on the bundled SmolLM2
tokenizer, with the tiny model's sizes and names, so token strings look real and the answers have the
shapes the real engine's have. Tests that check shapes, refusals and streaming formats use `fake_client`;
tests that compare numbers with the float64 `reference` or with the engine's own answers use `client`."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from fake_backend import FakeBackend
from logprobe.api.app import create_app
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
