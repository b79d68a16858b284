"""`logprobe serve` before it loads anything: every flag explains itself in --help, and a port another
listener holds is refused, one process or --replicas, with one clear message and exit code 2, before a
model is loaded or Ray is started. The listeners here stand for each kind of holder: a plain socket (a
one-process logprobe's uvicorn, any other program) and one bound with SO_REUSEPORT (Ray Serve's proxy,
which a second proxy would join)."""

from __future__ import annotations

import argparse
import socket

import pytest

from logprobe import cli
from logprobe.config import build_parser


def _subparser(name: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[name]


@pytest.mark.parametrize("command", ["serve", "score"])
def test_every_flag_has_help(command):
    parser = _subparser(command)
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(flags) > (40 if command == "serve" else 8)
    missing = [a.option_strings[0] for a in flags if not (a.help or "").strip()]
    assert missing == []
    text = parser.format_help()
    if command == "serve":
        assert "--max-vocab-entries" in text and "the hold: most (prompt + max_tokens)" in " ".join(text.split())


def _listener(reuse_port: bool, reuse_address: bool = False) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if reuse_address:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


@pytest.mark.parametrize("reuse_port", [False, True], ids=["plain", "reuseport"])
def test_a_held_port_is_seen(reuse_port):
    with _listener(reuse_port) as held:
        port = held.getsockname()[1]
        assert "already in use" in cli.port_taken("127.0.0.1", port)
        assert "already in use" in cli.port_taken("0.0.0.0", port)  # every address overlaps 127.0.0.1
    assert cli.port_taken("127.0.0.1", port) is None  # closed: free again


def test_a_port_left_in_time_wait_is_free():
    """A server's last connections linger in TIME_WAIT after it exits; the port is free for the next
    (a server that set SO_REUSEADDR, as uvicorn does)."""
    with _listener(False, reuse_address=True) as server:
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server side closes first: its end goes to TIME_WAIT
        client.close()
    assert any(c.split()[0] == "TIME-WAIT" for c in _connections(port))
    assert cli.port_taken("127.0.0.1", port) is None


def _connections(port: int) -> list[str]:
    """`/proc/net/tcp` rows of this port as "STATE local remote" (TIME-WAIT is state 06)."""
    rows = []
    with open("/proc/net/tcp") as fh:
        for line in list(fh)[1:]:
            _, local, remote, state = line.split()[:4]
            if int(local.split(":")[1], 16) == port:
                rows.append(f"{'TIME-WAIT' if state == '06' else state} {local} {remote}")
    return rows


@pytest.mark.parametrize("replicas", [[], ["--replicas", "1"]], ids=["one-process", "replicas"])
@pytest.mark.parametrize("reuse_port", [False, True], ids=["plain", "reuseport"])
def test_serve_refuses_a_held_port_before_any_work(monkeypatch, capsys, replicas, reuse_port):
    monkeypatch.setattr(cli, "serve", lambda settings: pytest.fail("one process started"))
    monkeypatch.setattr(cli, "serve_replicas", lambda settings: pytest.fail("Ray started"))
    with _listener(reuse_port) as held:
        port = held.getsockname()[1]
        assert cli.main(["serve", "--port", str(port), *replicas]) == 2
    err = capsys.readouterr().err
    assert f"logprobe: 127.0.0.1:{port} is already in use" in err and "--port" in err
