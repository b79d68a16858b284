"""Memory of a server that answers whole-vocabulary requests at its cap, one after another.

For each model a fresh `logprobe serve` is started; after a 4-token warm-up request (which builds the
per-model encoder tables, as any first request would) five `prompt_logprobs: -1` requests at the model's
whole-vocabulary cap (the card's `limits.vocab_positions`) are sent in turn, each streamed to the last
byte and discarded. Printed: the server's resident memory idle, after the warm-up, its peak (VmHWM) over
the five, its RSS after the first and after the fifth, private memory (RssAnon) after each, and each
request's seconds and bytes.

    python benchmarks/vocab_memory.py [--model smollm2-135m] [--model gemma3-270m] [--requests 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import httpx

TEXT = "The quick brown fox jumps over the lazy dog while the sky turns a deeper shade of blue. " * 40


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mem_mb(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":")) / 1024


def measure(model: str, requests: int) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "logprobe.cli", "serve", "--model", model, "--port", str(port),
                             "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(1200):
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        card = httpx.get(f"{base}/v1/models/{model}").json()
        cap, vocab = card["limits"]["vocab_positions"], card["vocab_size"]
        ids = httpx.post(base + "/tokenize", json={"model": model, "prompt": TEXT}).json()["tokens"][:cap]
        idle, idle_private = mem_mb(proc.pid, "VmRSS"), mem_mb(proc.pid, "RssAnon")
        httpx.post(base + "/v1/completions", timeout=600,
                   json={"model": model, "prompt": ids[:4], "max_tokens": 0, "prompt_logprobs": -1})
        warm, warm_private = mem_mb(proc.pid, "VmRSS"), mem_mb(proc.pid, "RssAnon")
        after, private, runs = [], [], []
        for _ in range(requests):
            t0, size = time.perf_counter(), 0
            with httpx.stream("POST", base + "/v1/completions", timeout=600, json={
                    "model": model, "prompt": ids, "max_tokens": 0, "prompt_logprobs": -1}) as r:
                assert r.status_code == 200, r.read()
                for chunk in r.iter_raw(1 << 20):
                    size += len(chunk)
            runs.append((time.perf_counter() - t0, size))
            after.append(mem_mb(proc.pid, "VmRSS"))
            private.append(mem_mb(proc.pid, "RssAnon"))
        peak = mem_mb(proc.pid, "VmHWM")
    finally:
        proc.terminate()
        proc.wait()
    print(f"{model}: vocabulary {vocab:,}, cap {cap} positions ({len(ids)} prompt tokens sent), float32, "
          f"{os.cpu_count()} cores")
    print(f"  RSS idle {idle:,.0f} MB, after the warm-up {warm:,.0f} MB; over {requests} requests at the cap: "
          f"peak {peak:,.0f} MB, after the first {after[0]:,.0f} MB, after the last {after[-1]:,.0f} MB")
    print("  requests: " + ", ".join(f"{s:.1f} s / {n / 1e9:.2f} GB" for s, n in runs))
    print("  RSS after each (MB): " + ", ".join(f"{m:,.0f}" for m in after))
    print(f"  private memory (RssAnon; RSS also counts the weights' file pages a float32 model maps, touched by "
          f"its first forward): idle {idle_private:,.0f} MB, after the warm-up {warm_private:,.0f} MB, after each: "
          + ", ".join(f"{m:,.0f}" for m in private))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", default=[])
    ap.add_argument("--requests", type=int, default=5)
    opts = ap.parse_args()
    for model in opts.model or ["smollm2-135m", "gemma3-270m"]:
        measure(model, opts.requests)


if __name__ == "__main__":
    main()
