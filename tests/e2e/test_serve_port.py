"""A second `logprobe serve` on a running server's port exits at once with one clear line and code 2,
before loading a model; the running server keeps answering. (Against a Ray Serve deployment, and
`--replicas` against a one-process server: tests/e2e/test_replicas.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

pytestmark = pytest.mark.e2e


def test_a_second_server_on_the_port_is_refused(server):
    port = server.rsplit(":", 1)[1]
    out = subprocess.run([sys.executable, "-m", "logprobe.cli", "serve", "--port", port], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"logprobe: 127.0.0.1:{port} is already in use (another logprobe, a Ray Serve deployment or another "
        "program listens there): stop it or choose another --port")
    assert "Traceback" not in out.stderr and "Loading" not in out.stderr
    assert httpx.get(server + "/health", timeout=30).json()["status"] == "ready"
