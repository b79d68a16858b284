"""What comparing models of different tokenizers on one text costs (`/v1/compare` with `align: "text"`)
against scoring the text with each model (`/v1/score`).

    python benchmarks/compare_text.py [--rounds 7] [--tokens 256]

It starts one server with the two bundled models (SmolLM2-135M and Gemma 3 270M: different tokenizers)
on a free 127.0.0.1 port and builds a text of --tokens SmolLM2 tokens. In alternating rounds (the order
flips each round) it times (a) one compare call of the text, (b) the two /v1/score calls of it one after
the other, and (c) the same two score calls sent at once (the compare runs its two passes at once, each
on its own engine). Every call reads a text of its own (a different four-digit number in front, one
token a digit in both tokenizers), so no call finds another's tokens in the prefix cache and every arm
runs whole passes. It prints each round, the medians, and the ratios a/b and a/c: the compare's cost
over the models' own passes (the alignment, the spans and a larger answer are what it adds). Last, in
this process, the compare's own work on the same text with both models' tokenizers (tokenizing, the
alignment and formatting the answer, on made-up log probabilities), beside the two /v1/score
tokenizations alone.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

_spec = importlib.util.spec_from_file_location("logprobe_servers", Path(__file__).parent / "servers.py")
servers = importlib.util.module_from_spec(_spec)
sys.modules["logprobe_servers"] = servers
_spec.loader.exec_module(servers)

MODELS = ["smollm2-135m", "gemma3-270m"]
PARAGRAPH = ("The naïve café owner said that 日本語 is fun to learn 🙂, and that the quick brown fox jumps over "
             "the lazy dog while 1234 ÷ 7 ≈ 176.29. Researchers compare language models on the same text to see "
             "where they disagree: names, numbers, rare words and punctuation. ")


def text_of(base: str, tokens: int) -> str:
    """The paragraph repeated and cut to `tokens` SmolLM2 tokens (at a character)."""
    ids = httpx.post(base + "/tokenize", json={"model": MODELS[0], "prompt": PARAGRAPH * (tokens // 20 + 1),
                                               "add_special_tokens": False}, timeout=600).json()["tokens"]
    text = httpx.post(base + "/detokenize", json={"model": MODELS[0], "tokens": ids[:tokens]}, timeout=600).json()
    return text["prompt"].rstrip("\ufffd")


async def timed(calls) -> float:
    t0 = time.perf_counter()
    for r in await asyncio.gather(*calls):
        r.raise_for_status()
    return time.perf_counter() - t0


async def measure(base: str, text: str, rounds: int) -> dict[str, list[float]]:
    numbers = iter(range(1000, 10000))

    def fresh() -> str:
        """The text behind a number no call has used: nothing of it is in the prefix cache."""
        return f"{next(numbers)}. {text}"

    async with httpx.AsyncClient(base_url=base, timeout=600) as c:
        def compare(input):
            return c.post("/v1/compare", json={"models": MODELS, "input": input, "align": "text"})

        def score(model, input):
            return c.post("/v1/score", json={"model": model, "input": input})

        async def sequential():
            input = fresh()
            return await timed([score(MODELS[0], input)]) + await timed([score(MODELS[1], input)])

        async def at_once():
            input = fresh()
            return await timed([score(m, input) for m in MODELS])

        arms = {"compare": lambda: timed([compare(fresh())]), "two scores, one after the other": sequential,
                "two scores at once": at_once}
        for arm in arms.values():  # warm both engines and every path
            await arm()
        times = {name: [] for name in arms}
        for r in range(rounds):
            order = list(arms) if r % 2 == 0 else list(arms)[::-1]
            for name in order:
                times[name].append(await arms[name]())
            print(f"round {r}: " + ", ".join(f"{name} {times[name][-1]:.3f} s" for name in arms), flush=True)
        return times


def own_work_ms(text: str, repeats: int = 20) -> tuple[float, float, float]:
    """Median milliseconds of the compare's tokenize step (both models' tokens and the alignment), of its
    formatting, and of the two /v1/score tokenizations alone, in this process."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from logprobe.api.compare import serving as comparing, spans as span_comparing
    from logprobe.api.score import serving as scoring
    from logprobe.engine.runners import loader
    from logprobe.tokens import TokenTable

    dirs = [loader.ensure_cached(str(loader.bundled_gguf_path())),
            loader.ensure_packaged_cached(loader.packaged_model(MODELS[1]))]
    models = []
    for i, directory in enumerate(dirs):
        tok = AutoTokenizer.from_pretrained(str(directory))
        info = SimpleNamespace(name=MODELS[i], bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                               vocab_size=len(tok), context_length=8192)
        models.append(SimpleNamespace(tokenizer=tok, info=info, table=TokenTable.build(tok, len(tok))))
    models = tuple(models)
    req = comparing.CompareRequest(list(MODELS), text, None, True, False, "text")
    times = []
    for _ in range(repeats + 3):
        t0 = time.perf_counter()
        item = span_comparing.tokenize(models, req)
        t1 = time.perf_counter()
        outputs = [SimpleNamespace(prompt_columns=SimpleNamespace(logprobs=-np.random.rand(len(s.token_ids)).astype(np.float32)))
                   for s in item.scored]
        t2 = time.perf_counter()
        span_comparing.format_response(models, req, item, [], outputs)
        t3 = time.perf_counter()
        for backend in models:
            scoring.tokenize(backend, span_comparing.score_request(req, backend))
        times.append(((t1 - t0) * 1e3, (t3 - t2) * 1e3, (time.perf_counter() - t3) * 1e3))
    return tuple(float(x) for x in np.median(np.array(times[3:]), axis=0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    server = servers.start(["--model", MODELS[0], "--model", MODELS[1]], prefix="logprobe-compare-text-")
    try:
        text = text_of(server.base, args.tokens)
        counts = [len(httpx.post(server.base + "/tokenize", json={"model": m, "prompt": text, "add_special_tokens": False},
                                 timeout=600).json()["tokens"]) for m in MODELS]
        print(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; machine: {os.cpu_count()} "
              f"cores ({platform.machine()}), CPU, float32; command: python benchmarks/compare_text.py --rounds "
              f"{args.rounds} --tokens {args.tokens}")
        print(f"text: {len(text)} characters, {len(text.encode())} bytes; tokens: {MODELS[0]} {counts[0]}, "
              f"{MODELS[1]} {counts[1]} (each with its BOS in front)")
        times = asyncio.run(measure(server.base, text, args.rounds))
    finally:
        server.terminate()
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, value in medians.items():
        print(f"median {name}: {value:.3f} s")
    one = medians["compare"]
    print(f"compare / two scores one after the other: {one / medians['two scores, one after the other']:.3f}")
    print(f"compare / two scores at once: {one / medians['two scores at once']:.3f}")
    tokenize_ms, format_ms, score_ms = own_work_ms(text)
    print(f"in process, median ms: the compare's tokenize step {tokenize_ms:.2f} (the two /v1/score tokenizations "
          f"alone {score_ms:.2f}), its formatting {format_ms:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
