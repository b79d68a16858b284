"""The soak, in the suite: one long-lived server on the bundled model, a seeded mix of every kind of
request in bursts with idle gaps (benchmarks/soak.py, the same code the long soak runs), for about a
minute. Its context is cut to 1024 tokens and its KV cache starts at 32 positions per sequence, so that
generations of up to three times that length and one that ends at the context stay cheap, and the cache
grows and shrinks again and again. Every answer is compared with the same request's sent alone, bit for
bit (float32 on the lean runner: docs/api.md, "The same bits beside other requests").

Slow: the soak runs for 40 s by design."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import httpx
import pytest

from logprobe.engine.runners.lean.attention import Attention
from test_load_and_faults import server_log, start_server  # noqa: E402 (same folder)

pytestmark = pytest.mark.e2e
FIRST_LEN = 32
PREFIX_MB = 64  # every request fills the prefix cache: small enough that the soak evicts from it


def load_soak():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
    spec = importlib.util.spec_from_file_location("logprobe_soak", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_soak_mix_with_idle_gaps():
    soak = load_soak()
    proc, base = start_server("--max-model-len", "1024", "--kv-cache-positions", str(FIRST_LEN),
                              "--prefix-cache-mb", str(PREFIX_MB))
    try:
        # every answer the same bits as the same request alone (float32 on the lean runner, torch >= 2.13)
        res, health = soak.run_soak(base, seed=1, seconds=40, first_len=FIRST_LEN, max_requests=600, pid=proc.pid,
                                    exact=Attention.invariant_kernels())
        print("\n" + soak.summary(res, health, 40))
        metrics = httpx.get(base + "/metrics", timeout=30).text
    finally:
        proc.terminate()
        proc.wait(timeout=600)  # the drain (30 s at most) and the exit, on a loaded machine
    log = server_log(proc)
    assert not res.problems, res.problems[:10]
    assert set(res.statuses) <= {0, 200}, res.statuses  # 0: a client that left on purpose
    assert res.served >= 30 and res.left >= 1
    assert res.shrinks >= 2, "the KV cache did not grow and shrink back at least twice"
    # memory returns when idle, but for what the prefix cache keeps (kept when idle, within its bound)
    assert all(mb <= PREFIX_MB for mb in res.prefix_idle_mb), res.prefix_idle_mb
    idle = [mb - cached for (_, mb), cached in zip(res.rss_idle_mb, res.prefix_idle_mb)]
    assert idle[-1] <= idle[0] * 1.10 + 64, idle
    assert set(res.latency) == res.kinds and len(res.kinds) >= 27  # every kind of the catalog ran
    # every kind of request went through the prefix cache (it holds some still: it is kept when idle)
    cached = re.search(r"^logprobe_prefix_cache_bytes (\S+)$", metrics, re.M)
    assert cached and 0 < float(cached.group(1)) <= PREFIX_MB * 2**20
    hits = re.search(r"^logprobe_prefix_cache_hits (\S+)$", metrics, re.M)
    assert hits and float(hits.group(1)) > 0
    assert health["status"] == "ready"
    assert (health["requests_running"], health["requests_queued"], health["tokens_held"], health["in_flight"]) == \
        (0, 0, 0, 0)
    assert health["engine_failures"] == {"steps": 0, "requests": 0}
    # no 5xx but the /health probes of the start (503 while the model loaded)
    assert not re.search(r'logprobe_requests_total\{path="(?!/health")[^"]*",status="5\d\d"\}', metrics)
    assert "Traceback" not in log, log[-3000:]
