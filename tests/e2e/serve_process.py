"""Start a real `logprobe serve` process for end-to-end tests and wait until it answers /health."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_log(proc) -> str:
    with open(proc.log_path, encoding="utf-8", errors="replace") as fh:
        return fh.read()


def start(flags, head=None, limit: float = 900, prefix: str = "logprobe-"):
    """(process, base URL) of `logprobe serve --port P *flags`, run by `head` (default: the module). The
    log goes to a file (`proc.log_path`): a pipe nobody reads fills up and blocks the server."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix=prefix, suffix=".log", delete=False)
    command = (head or [sys.executable, "-m", "logprobe.cli"]) + ["serve", "--port", str(port), *flags]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    proc.log_path = log.name
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + limit
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited:\n" + server_log(proc))
        try:
            if httpx.get(base + "/health", timeout=30).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not start")


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
