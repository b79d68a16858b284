"""The whole-vocabulary benchmark (docs/performance.md): `prompt_logprobs: -1` on 256 prompt tokens.

logprobe: a real `logprobe serve` process on the bundled model; seconds from sending the request to the
last byte of the response (streamed and discarded by the client), and the server's peak RSS growth
(VmHWM after minus VmRSS before; the server is restarted for each repetition so VmHWM is per request).

Peer, in the same run: the same numbers (log probabilities and ranks of all 49,152 tokens at 255
positions) built as Python dicts and written with `json.dumps` — the vLLM-style path — in a child
process, timed from ready arrays to the finished string (it does no forward pass and no HTTP, so the
ratio flatters the peer), and its peak RSS growth.

    python benchmarks/whole_vocab.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np

MODEL = "smollm2-135m"
TEXT = "The quick brown fox jumps over the lazy dog while the sky turns a deeper shade of blue. " * 30

PEER = r'''
import json, sys, time
import numpy as np
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
lps = np.load(sys.argv[1]); ranks = np.load(sys.argv[2]); names = json.load(open(sys.argv[3]))
base = rss("VmRSS:")
t0 = time.perf_counter()
out = [None]
for pos in range(1, lps.shape[0]):
    vals, rk = lps[pos].tolist(), ranks[pos].tolist()
    out.append({str(i): {"logprob": vals[i], "rank": rk[i], "decoded_token": names[i]} for i in range(len(vals))})
body = json.dumps({"choices": [{"prompt_logprobs": out}]})
print(time.perf_counter() - t0, rss("VmHWM:") - base, len(body))
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_mem(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def start_server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "logprobe.cli", "serve", "--port", str(port),
                             "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


def timed_request(base: str, body: dict) -> tuple[float, int]:
    t0 = time.perf_counter()
    size = 0
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600) as r:
        assert r.status_code == 200, r.read()
        for chunk in r.iter_raw(1 << 20):
            size += len(chunk)
    return time.perf_counter() - t0, size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    times, growths, size = [], [], 0
    ids = None
    for _ in range(args.repeat):
        port = free_port()
        proc = start_server(port)
        base = f"http://127.0.0.1:{port}"
        try:
            ids = httpx.post(base + "/tokenize", json={"prompt": TEXT}).json()["tokens"][:256]
            # warm-up: builds the per-model encoder once, as any earlier request would
            timed_request(base, {"model": MODEL, "prompt": ids[:4], "max_tokens": 0, "prompt_logprobs": -1})
            before = proc_mem(proc.pid, "VmRSS:")
            elapsed, size = timed_request(base, {"model": MODEL, "prompt": ids, "max_tokens": 0,
                                                 "prompt_logprobs": -1})
            growths.append(proc_mem(proc.pid, "VmHWM:") - before)
            times.append(elapsed)
            if len(times) == 1:
                dense = httpx.post(base + "/v1/completions", timeout=600, json={
                    "model": MODEL, "prompt": ids, "max_tokens": 0, "prompt_logprobs": -1,
                    "vocab_encoding": "float32"}).json()
                names = [None]
        finally:
            proc.terminate()
            proc.wait()

    from logprobe.client import dense_prompt_logprobs

    lps = dense_prompt_logprobs(dense["choices"][0]["prompt_logprobs"])
    lps[0] = 0.0
    order = np.sort(-lps, axis=1)
    ranks = np.stack([np.searchsorted(order[p], -lps[p], side="left") + 1 for p in range(lps.shape[0])])
    from transformers import AutoTokenizer

    from logprobe.engine.runners import loader
    from logprobe.tokens import TokenTable

    tok = AutoTokenizer.from_pretrained(str(loader.ensure_cached(str(loader.bundled_gguf_path()))))
    names = TokenTable.build(tok, lps.shape[1]).strings.tolist()
    with tempfile.TemporaryDirectory() as tmp:
        import json

        np.save(f"{tmp}/l.npy", lps)
        np.save(f"{tmp}/r.npy", ranks)
        json.dump(names, open(f"{tmp}/n.json", "w"))
        out = subprocess.run([sys.executable, "-c", PEER, f"{tmp}/l.npy", f"{tmp}/r.npy", f"{tmp}/n.json"],
                             capture_output=True, text=True, check=True).stdout.split()
    peer_time, peer_growth, peer_size = float(out[0]), int(out[1]), int(out[2])
    med = statistics.median(times)
    print(f"conditions: {MODEL} float32 on CPU ({os.cpu_count()} cores), 256 prompt tokens, "
          f"prompt_logprobs=-1, max_tokens=0, {args.repeat} runs, median")
    print(f"logprobe end to end (forward + encode + HTTP to last byte): {med:.2f} s "
          f"(runs: {', '.join(f'{t:.2f}' for t in times)}), {size / 1e6:.0f} MB, "
          f"server peak RSS growth {statistics.median(growths) / 2**20:.0f} MiB")
    print(f"peer: Python dicts + json.dumps from ready arrays: {peer_time:.2f} s, {peer_size / 1e6:.0f} MB, "
          f"peak RSS growth {peer_growth / 2**20:.0f} MiB")
    print(f"ratio (peer time / logprobe time): {peer_time / med:.1f}x")


if __name__ == "__main__":
    main()
