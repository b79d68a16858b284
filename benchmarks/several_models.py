"""Two models in one server (`--model A --model B`, one engine each) against one model: what sharing the
machine's cores costs.

    python benchmarks/several_models.py [--requests 32] [--rounds 3]

It starts one server with the bundled model twice over (its GGUF, and the dequantized transformers
directory logprobe caches: the same weights, two engines) on a free 127.0.0.1 port, and in alternating
rounds sends the same load (16 concurrent clients, greedy generations of 32 tokens with logprobs 5) to
(a) the first model only and (b) half to each model. It prints generated tokens/s of each round and the
ratio b/a: about 1.0 means two engines share the cores as well as one engine batches; below, the cost of
two step loops competing for them. Bounded: --requests per round, 120 s per round at most.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import os
import platform
import sys
import time
from pathlib import Path

import httpx

_spec = importlib.util.spec_from_file_location("logprobe_servers", Path(__file__).parent / "servers.py")
servers = importlib.util.module_from_spec(_spec)
sys.modules["logprobe_servers"] = servers
_spec.loader.exec_module(servers)

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The weather today",
           "In 1969, astronauts", "My favourite recipe", "The stock market", "A haiku about the sea"]


async def load(base: str, models: list[str], requests: int, concurrency: int = 16, limit_s: float = 120) -> float:
    """Generated tokens per second over `requests` requests, spread over `models` in turn."""
    queue = list(range(requests))
    tokens = 0
    deadline = time.monotonic() + limit_s

    async def client(c: httpx.AsyncClient):
        nonlocal tokens
        while queue and time.monotonic() < deadline:
            i = queue.pop()
            body = {"model": models[i % len(models)], "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 32,
                    "temperature": 0, "logprobs": 5}
            r = await c.post(base + "/v1/completions", json=body)
            r.raise_for_status()
            tokens += r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=300) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*[client(c) for _ in range(concurrency)])
        return tokens / (time.perf_counter() - t0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from logprobe.engine.runners import loader

    directory = loader.ensure_cached(str(loader.bundled_gguf_path()))
    server = servers.start(["--model", "smollm2-135m", "--model", str(directory), "--alias", "second"],
                           prefix="logprobe-two-models-")
    print(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; machine: {os.cpu_count()} "
          f"cores ({platform.machine()}); command: python benchmarks/several_models.py --requests "
          f"{args.requests} --rounds {args.rounds}")
    print("load: 16 concurrent clients, greedy, max_tokens 32, logprobs 5; one server, two engines (same weights)")
    try:
        asyncio.run(load(server.base, ["smollm2-135m", "second"], 16))  # warm both
        one, two = [], []
        for r in range(args.rounds):
            order = [("one", ["smollm2-135m"]), ("two", ["smollm2-135m", "second"])]
            for label, models in (order if r % 2 == 0 else order[::-1]):
                tps = asyncio.run(load(server.base, models, args.requests))
                (one if label == "one" else two).append(tps)
                print(f"round {r + 1}: {'one model ' if label == 'one' else 'two models'} {tps:7.1f} tok/s")
        a, b = sorted(one)[len(one) // 2], sorted(two)[len(two) // 2]
        print(f"median: one model {a:.1f} tok/s, half to each of two models {b:.1f} tok/s, ratio {b / a:.2f}")
    finally:
        server.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
