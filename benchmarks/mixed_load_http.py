"""The mixed load through the server, as a client sees it: `logprobe serve` on the bundled model, 16
sampled streams of 64 tokens (`/v1/completions`, streamed, `logprobs: 5`) while 8 clients each score
new ~500-token texts (`/v1/score`) in a loop; meanwhile one interactive stream at a time (a 20-token
prompt, 16 greedy tokens, streamed) whose time to first token (request sent to the first chunk with a
token) is taken five times in a row. Before the load, the same stream on the idle server gives the
idle time to first token. benchmarks/mixed_load.py measures the same load in-process; this one adds
HTTP, the event loop and the JSON of every answer.

    python benchmarks/mixed_load_http.py [--baseline /path/to/other/checkout/src] [--rounds 3]
                                         [--dtype float32]

Per side and round (a fresh server each, sides alternating): idle and loaded time to first token (the
median of 5 and the worst), loaded / idle, and the tokens per second over the load (tokens the streams
generated plus the texts' tokens scored until the streams end, over that wall time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import servers  # noqa: E402

HERE = str(Path(__file__).resolve().parents[1] / "src")
WORDS = ["river", "stone", "lamp", "garden", "winter", "letter", "harbour", "field", "clock", "bridge",
         "window", "forest", "road", "candle", "silver", "morning", "copper", "meadow", "tower", "salt"]


def text(salt: int, n: int) -> str:
    return f"Record {salt}: " + " ".join(WORDS[(salt * 13 + j * (salt % 7 + 3)) % len(WORDS)] + str((salt + j) % 97)
                                         for j in range(n))


async def stream(client: httpx.AsyncClient, model: str, prompt: str, **body) -> tuple[float, int]:
    """(seconds to the first token, tokens) of one streamed completion."""
    t0, first, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", "/v1/completions", json={"model": model, "prompt": prompt, "stream": True,
                                                               **body}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                tokens += 1 if chunk["choices"][0]["text"] or chunk["choices"][0].get("logprobs") else 0
                if first is None:
                    first = time.perf_counter() - t0
    return first, tokens


async def probe(client, model, salt) -> float:
    return (await stream(client, model, text(salt, 6), max_tokens=16, temperature=0))[0]


async def load(base: str) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=None,
                                 limits=httpx.Limits(max_connections=64, max_keepalive_connections=64)) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await probe(client, model, 1)  # warm
        idle = [await probe(client, model, 10_000 + i) for i in range(5)]
        done, scored = asyncio.Event(), [0]

        async def scorer(c: int) -> None:
            n = 0
            while not done.is_set():
                r = await client.post("/v1/score", json={"model": model, "input": text(100 * c + n, 150)})
                r.raise_for_status()
                n += 1
                if not done.is_set():
                    scored[0] += r.json()["usage"]["prompt_tokens"]

        t0 = time.perf_counter()
        streams = asyncio.gather(*[stream(client, model, text(5_000 + i, 8), max_tokens=64, temperature=1.0, seed=i,
                                          logprobs=5) for i in range(16)])
        scorers = [asyncio.ensure_future(scorer(c)) for c in range(8)]
        await asyncio.sleep(1.0)
        loaded = []
        for i in range(5):
            if streams.done():
                break
            loaded.append(await probe(client, model, 20_000 + i))
        generated = sum(n for _, n in await streams)
        wall = time.perf_counter() - t0
        scored_by_then = scored[0]
        done.set()
        await asyncio.gather(*scorers)
    return {"idle": idle, "loaded": loaded, "wall": wall, "generated": generated, "scored": scored_by_then}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="another checkout's src/ to run the same load against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    sides = [("this tree", HERE)] + ([("baseline", args.baseline)] if args.baseline else [])
    print("| side | round | idle TTFT ms (median / worst) | loaded TTFT ms (median / worst) | loaded / idle "
          "| tokens/s (generated + scored / s) |\n| --- | --- | --- | --- | --- | --- |", flush=True)
    for round_ in range(1, args.rounds + 1):
        for name, src in sides:
            os.environ["PYTHONPATH"] = src
            server = servers.start(["--dtype", args.dtype])
            try:
                r = asyncio.run(load(server.base))
            finally:
                server.terminate()
            idle, loaded = statistics.median(r["idle"]) * 1e3, statistics.median(r["loaded"]) * 1e3
            print(f"| {name} | {round_} | {idle:,.0f} / {max(r['idle']) * 1e3:,.0f} | {loaded:,.0f} / "
                  f"{max(r['loaded']) * 1e3:,.0f} | {loaded / idle:.1f}x | "
                  f"{(r['generated'] + r['scored']) / r['wall']:,.0f} ({r['generated']:,} + {r['scored']:,} / "
                  f"{r['wall']:.1f}) |", flush=True)


if __name__ == "__main__":
    main()
