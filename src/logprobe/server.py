"""The HTTP app of `logprobe serve` with everything it serves: the API (api/app.py) and, when asked, the
Batch API (batch/), which answers its lines through the API's pipeline."""

from __future__ import annotations

from fastapi import FastAPI

from .api import app as api_app
from .batch.runner import install as install_batches
from .config import AdmissionSettings, BatchSettings, Limits

attach_backend = api_app.attach_backend
attach_backends = api_app.attach_backends


def create_app(backend, limits: Limits | None = None, admission: AdmissionSettings | None = None, api_keys=(),
               admission_control=None, batch: BatchSettings | None = None) -> FastAPI:
    """api/app.py's `create_app`, with the Batch API (docs/batch.md) and its runner when `batch` is given."""
    app = api_app.create_app(backend, limits, admission, api_keys, admission_control)
    if batch is not None:
        install_batches(app, batch)
    return app
