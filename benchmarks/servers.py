"""Start `logprobe serve` (one process, or replicas on Ray Serve) on a free loopback port, and stop it with
everything it started. Used by benchmarks/replicas.py and tests/e2e/test_replicas.py.

A server with --replicas starts a local Ray: its processes (GCS, raylet, agents, workers) share the
server's session, so stopping kills the whole session by id after SIGTERM. Never `ray stop`: it kills
every Ray process on the machine, other people's included.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    base: str
    log: str

    def log_text(self) -> str:
        with open(self.log, errors="replace") as fh:
            return fh.read()

    def session_pids(self) -> list[int]:
        """Every live process of the server's session (itself, and Ray's processes when it started Ray)."""
        pids = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    if os.getsid(int(name)) == self.proc.pid:
                        pids.append(int(name))
                except (ProcessLookupError, PermissionError):
                    pass
        return pids

    def session_pids_running(self, marker: bytes) -> list[int]:
        """The session's processes whose command line holds `marker` (b"ModelReplica": the replicas'
        actors, b"ProxyActor": Serve's proxies), in pid order."""
        found = []
        for pid in sorted(self.session_pids()):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    if marker in fh.read():
                        found.append(pid)
            except OSError:  # it exited meanwhile
                pass
        return found

    def terminate(self, timeout: float = 60) -> int | None:
        """SIGTERM, wait for the exit (the drain), then kill what is left of the session. The exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        deadline = time.time() + 10
        while self.session_pids() and time.time() < deadline:  # Ray's processes exit on their own
            time.sleep(0.2)
        for pid in self.session_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)
        return code


def start(flags: list[str], ready_timeout: float = 900, prefix: str = "logprobe-") -> Server:
    """`logprobe serve --port P FLAGS` in a session of its own; returns once /health answers 200 (for
    replicas: once every replica has reported ready). A process that exits fails at once; the time-out
    only stops a start that hangs (a Ray cluster of replicas beside a test suite on workers may take
    minutes on a loaded 2-core machine)."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix=prefix, suffix=".log", delete=False)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "logprobe.cli", "serve", "--port", str(port), *flags],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = Server(proc, f"http://127.0.0.1:{port}", log.name)
    want = None
    if "--replicas" in flags:
        want = flags[flags.index("--replicas") + 1].split(":")[0]
    deadline = time.time() + ready_timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            server.terminate()
            raise RuntimeError("server exited:\n" + server.log_text()[-5000:])
        try:
            r = httpx.get(server.base + "/health", timeout=2)
            if r.status_code == 200 and (want is None or r.json()["replicas"]["ready"] >= int(want)):
                return server
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    server.terminate()
    raise RuntimeError("server did not start:\n" + server.log_text()[-5000:])
