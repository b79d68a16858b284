"""Replicas kept busy while the address keeps answering: `logprobe serve --replicas N` under a load that
saturates every replica for a sustained period, with a health probe and small requests on the side.

    python benchmarks/saturation.py [--seconds 300] [--clients 8] [--replicas 2] [--cpus-per-replica 2]
                                    [--ray-cpus 4]

It starts its own server (benchmarks/servers.py: a session of its own on a free 127.0.0.1 port, stopped
with every Ray process of its session) and runs, for --seconds:

- the load: --clients clients, each sending streamed completions (max_tokens 48, greedy) one after
  another until the time is up, so every replica always has work waiting; and --whole-vocab-clients
  more asking for whole-vocabulary JSON answers (prompt_logprobs -1 on ~30 tokens, ~120 MB each),
  bodies that keep the ingress and the proxy busy too;
- the probes, one after another with a 1 s pause: GET /health, POST /tokenize (answered by the ingress
  alone) and a 1-token completion (through a replica, behind the load).

Every request has an explicit 120 s timeout. It reports the requests finished, every failure (a dropped
connection, a status other than 200, a stream without [DONE]), the slowest probe, the most requests the
engines held at once, and whether Serve's proxy process was replaced (its pid before and after). The
same function runs, shorter, in tests/e2e/test_replicas.py.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import sys
import time

import httpx

MODEL = "smollm2-135m"
TIMEOUT = httpx.Timeout(120.0)
PROMPTS = ["The history of the city goes back to", "Scientists measured the temperature of",
           "She opened the old book and found", "Most of the birds leave the island before"]


async def _load_client(client: httpx.AsyncClient, base: str, i: int, deadline: float, out: dict) -> None:
    body = {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 48, "temperature": 0,
            "stream": True}
    while not out["done"]:
        try:
            async with client.stream("POST", base + "/v1/completions", json=body) as r:
                lines = [line async for line in r.aiter_lines() if line]
            if r.status_code != 200 or not lines or lines[-1] != "data: [DONE]":
                out["failures"].append(f"load: status {r.status_code}, last line {lines[-1:]!r}")
            else:
                out["finished"] += 1
        except httpx.HTTPError as exc:
            out["failures"].append(f"load: {type(exc).__name__}: {exc}")


async def _whole_vocab_client(client: httpx.AsyncClient, base: str, deadline: float, out: dict) -> None:
    """Whole-vocabulary answers as JSON (about 4 MB a position): big bodies through the ingress and proxy."""
    body = {"model": MODEL, "prompt": " ".join(PROMPTS), "max_tokens": 0, "prompt_logprobs": -1}
    while not out["done"]:
        try:
            r = await client.post(base + "/v1/completions", json=body)
            if r.status_code != 200:
                out["failures"].append(f"whole vocabulary: status {r.status_code}")
            else:
                out["finished"] += 1
        except httpx.HTTPError as exc:
            out["failures"].append(f"whole vocabulary: {type(exc).__name__}: {exc}")


async def _probe(client: httpx.AsyncClient, base: str, deadline: float, out: dict, min_probes: int,
                 last: float) -> None:
    small = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    # at least `seconds`; then on (up to ten times as long) until `min_probes` probes have been answered,
    # a request has finished and the engines were seen with two at once, however slow the machine
    while time.monotonic() < deadline or (time.monotonic() < last and min_probes and (
            out["probes"] < min_probes or out["finished"] < 1 or out["most_in_flight"] < 2)):
        for method, path, body in (("GET", "/health", None), ("POST", "/tokenize", {"model": MODEL, "prompt": "Hi"}),
                                   ("POST", "/v1/completions", small)):
            t0 = time.monotonic()
            try:
                r = await client.request(method, base + path, json=body)
            except httpx.HTTPError as exc:
                out["failures"].append(f"probe {path}: {type(exc).__name__}: {exc}")
                continue
            out["slowest_probe_s"] = max(out["slowest_probe_s"], time.monotonic() - t0)
            if r.status_code != 200:
                out["failures"].append(f"probe {path}: status {r.status_code}")
                continue
            out["probes"] += 1
            if path == "/health":
                health = r.json()
                out["most_in_flight"] = max(out["most_in_flight"], health.get("in_flight", 0))
                out["fewest_ready"] = min(out["fewest_ready"], health.get("replicas", {}).get("ready", 0))
        await asyncio.sleep(1.0)


async def _probes_then_stop(*args) -> None:
    out = args[3]
    try:
        await _probe(*args)
    finally:
        out["done"] = True  # the load clients stop after their request in flight


async def saturate(base: str, seconds: float, clients: int, whole_vocab_clients: int = 0,
                   min_probes: int = 0) -> dict:
    """Load and probes for `seconds` (longer while fewer than `min_probes` probes were answered, no
    request finished or the engines never held two: a test's minimum, not a speed); what happened."""
    out = {"finished": 0, "probes": 0, "failures": [], "slowest_probe_s": 0.0, "most_in_flight": 0,
           "fewest_ready": 1 << 30, "done": False}
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as load, \
            httpx.AsyncClient(timeout=TIMEOUT) as probes:
        await asyncio.gather(*[_load_client(load, base, i, deadline, out) for i in range(clients)],
                             *[_whole_vocab_client(load, base, deadline, out) for _ in range(whole_vocab_clients)],
                             _probes_then_stop(probes, base, deadline, out, min_probes, deadline + 9 * seconds))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=300, help="how long the load lasts (default 300)")
    ap.add_argument("--clients", type=int, default=8, help="concurrent load clients (default 8)")
    ap.add_argument("--whole-vocab-clients", type=int, default=0,
                    help="more clients asking for whole-vocabulary JSON answers (prompt_logprobs -1, ~30 tokens)")
    ap.add_argument("--replicas", default="2")
    ap.add_argument("--cpus-per-replica", default="2")
    ap.add_argument("--ray-cpus", default="4", help="CPUs the local Ray offers (default 4: 2 replicas x 2)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import servers

    flags = ["--replicas", args.replicas, "--cpus-per-replica", args.cpus_per_replica, "--ray-cpus", args.ray_cpus,
             "--log-level", "warning"]
    server = servers.start(flags, prefix="logprobe-saturation-")
    try:
        before = server.session_pids_running(b"ProxyActor")
        t0 = time.monotonic()
        result = asyncio.run(saturate(server.base, args.seconds, args.clients, args.whole_vocab_clients))
        elapsed = time.monotonic() - t0
        after = server.session_pids_running(b"ProxyActor")
    finally:
        server.terminate()
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
          f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}")
    print(f"# logprobe serve {' '.join(flags)}; {args.clients} streaming clients, {args.whole_vocab_clients} "
          f"whole-vocabulary clients; {elapsed:.0f} s")
    print(f"requests finished under load: {result['finished']}")
    print(f"probes answered: {result['probes']}, slowest {result['slowest_probe_s']:.1f} s")
    print(f"most requests in the engines at once: {result['most_in_flight']}; fewest replicas ready: "
          f"{result['fewest_ready']}")
    print(f"proxy pid before {before}, after {after}: {'the same' if before == after else 'REPLACED'}")
    print(f"failures: {len(result['failures'])}")
    for failure in result["failures"][:20]:
        print("  " + failure)


if __name__ == "__main__":
    main()
