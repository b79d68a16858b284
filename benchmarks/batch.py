"""The Batch API against clients, on the bundled model (docs/batch.md, "Measurements").

Arms, each on the same scoring lines of varied length, on one fresh `logprobe serve`:
  batch      one batch of every line (upload, create, wait until completed)
  clients-8  the same lines from 8 concurrent clients (one line a request)
  loop       the same lines from one client, one after another
and then an interactive one-stream request (`/v1/completions`, streamed, greedy) repeated while the
server is idle and again while a batch of every line runs: time to first token and tokens per second.

    python benchmarks/batch.py --lines 2000 --out batch.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).parent))
import servers  # noqa: E402

MODEL = "smollm2-135m"
WORDS = ("the river stone light quiet north paper glass field night storm a of and to in is was for on with as "
         "by at from that this it be are").split()


def score_bodies(n: int) -> list[dict]:
    """Texts of 8 to ~200 words (deterministic), a quarter of them after one shared context."""
    bodies = []
    for i in range(n):
        length = 8 + (i * 37) % 193
        text = " ".join(WORDS[(i * 7 + j * 13) % len(WORDS)] for j in range(length))
        body = {"model": MODEL, "input": text}
        if i % 4 == 0:
            body["context"] = "Score the following sentence as written by a careful writer:"
        bodies.append(body)
    return bodies


def tokens_of(answers: list[dict]) -> int:
    return sum(a["usage"]["prompt_tokens"] for a in answers)


def run_batch(base: str, bodies: list[dict]) -> tuple[float, int]:
    lines = [{"custom_id": str(i), "method": "POST", "url": "/v1/score", "body": b} for i, b in enumerate(bodies)]
    with httpx.Client(base_url=base, timeout=3600) as client:
        uploaded = client.post("/v1/files", data={"purpose": "batch"},
                               files={"file": ("b.jsonl", b"\n".join(map(orjson.dumps, lines)))}).json()
        t0 = time.perf_counter()
        batch = client.post("/v1/batches", json={"input_file_id": uploaded["id"], "endpoint": "/v1/score",
                                                 "completion_window": "24h"}).json()
        while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(0.1)
            batch = client.get(f"/v1/batches/{batch['id']}").json()
        seconds = time.perf_counter() - t0
        assert batch["status"] == "completed" and batch["request_counts"]["failed"] == 0, batch
        raw = client.get(f"/v1/files/{batch['output_file_id']}/content").content
    answers = [orjson.loads(x)["response"]["body"] for x in raw.splitlines()]
    return seconds, tokens_of(answers)


async def run_clients(base: str, bodies: list[dict], concurrency: int) -> tuple[float, int]:
    queue = list(reversed(bodies))
    answers = []

    async def worker(client):
        while queue:
            r = await client.post("/v1/score", json=queue.pop())
            r.raise_for_status()
            answers.append(r.json())

    async with httpx.AsyncClient(base_url=base, timeout=3600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*[worker(client) for _ in range(concurrency)])
        return time.perf_counter() - t0, tokens_of(answers)


def one_stream(base: str, max_tokens: int) -> tuple[float, float]:
    """(time to first token s, tokens per second after it) of one streamed greedy completion."""
    body = {"model": MODEL, "prompt": "The history of the river begins", "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first, count = None, 0
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=3600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"interactive request: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                count += 1
                first = first or time.perf_counter()
    end = time.perf_counter()
    return first - t0, (count - 1) / max(end - first, 1e-9)


def interactive(base: str, repeats: int, max_tokens: int, still_running=None) -> dict:
    """Median TTFT and tokens/s of `repeats` one-stream requests, with each sample; `still_running()`
    (during a batch) says after each sample whether the batch was still running, so a sample taken
    after the batch ended is told apart."""
    samples, running = [], []
    for _ in range(repeats):
        samples.append(one_stream(base, max_tokens))
        if still_running is not None:
            running.append(still_running())
    out = {"ttft_p50_s": statistics.median(s[0] for s in samples),
           "tokens_per_s_p50": statistics.median(s[1] for s in samples), "n": repeats,
           "samples": [{"ttft_s": round(t, 3), "tokens_per_s": round(r, 2)} for t, r in samples]}
    if still_running is not None:
        out["batch_running_after_each"] = running
    return out


def interactive_during_batch(base: str, bodies: list[dict], repeats: int, max_tokens: int) -> dict:
    lines = [{"custom_id": str(i), "method": "POST", "url": "/v1/score", "body": b} for i, b in enumerate(bodies)]
    with httpx.Client(base_url=base, timeout=3600) as client:
        uploaded = client.post("/v1/files", data={"purpose": "batch"},
                               files={"file": ("b.jsonl", b"\n".join(map(orjson.dumps, lines)))}).json()
        batch = client.post("/v1/batches", json={"input_file_id": uploaded["id"], "endpoint": "/v1/score",
                                                 "completion_window": "24h"}).json()
        while client.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"] < 20:
            time.sleep(0.05)
        during = interactive(base, repeats, max_tokens, lambda: client.get(
            f"/v1/batches/{batch['id']}").json()["status"] == "in_progress")
        client.post(f"/v1/batches/{batch['id']}/cancel")
    return during


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=10, help="interactive requests per condition")
    parser.add_argument("--max-tokens", type=int, default=32, help="of each interactive request")
    parser.add_argument("--loop-lines", type=int, default=0, help="lines for the one-client loop (0: all)")
    parser.add_argument("--only", choices=["throughput", "interactive"], help="run one part")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    bodies = score_bodies(args.lines)
    results = {"lines": args.lines, "load_average_before": os.getloadavg(),
               "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "python": platform.python_version()}
    with tempfile.TemporaryDirectory() as data_dir:
        server = servers.start(["--data-dir", data_dir])
        try:
            httpx.post(server.base + "/v1/score", json=bodies[0], timeout=600)  # warm up
            loop_bodies = bodies[:args.loop_lines or None]
            arms = () if args.only == "interactive" else (
                ("batch", lambda: run_batch(server.base, bodies)),
                ("clients-8", lambda: asyncio.run(run_clients(server.base, bodies, 8))),
                ("loop", lambda: asyncio.run(run_clients(server.base, loop_bodies, 1))))
            for name, run in arms:
                seconds, tokens = run()
                results[name] = {"seconds": round(seconds, 2), "tokens": tokens,
                                 "tokens_per_s": round(tokens / seconds, 1)}
                print(name, results[name], flush=True)
            if arms:
                results["batch_vs_clients8"] = round(results["batch"]["tokens_per_s"]
                                                     / results["clients-8"]["tokens_per_s"], 3)
            if args.only == "throughput":
                return finish(results, args.out)
            results["interactive_idle"] = interactive(server.base, args.repeats, args.max_tokens)
            print("interactive idle", results["interactive_idle"], flush=True)
            results["interactive_during_batch"] = interactive_during_batch(server.base, bodies, args.repeats,
                                                                           args.max_tokens)
            print("interactive during a batch", results["interactive_during_batch"], flush=True)
            results["ttft_ratio"] = round(results["interactive_during_batch"]["ttft_p50_s"]
                                          / results["interactive_idle"]["ttft_p50_s"], 3)
        finally:
            server.terminate()
    finish(results, args.out)


def finish(results: dict, out: str | None) -> None:
    print(json.dumps(results, indent=2))
    if out:
        Path(out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
