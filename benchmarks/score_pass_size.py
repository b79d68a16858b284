"""What a smaller prompt-only pass costs: 8 new ~500-token scoring requests (prompt_logprobs 1) as passes
of one request each (the scheduler's `score_batch_tokens` at 512, what a pass holds while rows decode)
against one pass of all eight (4,096, its idle default), on one engine, the arms alternating which goes
first, every text new. `--blocks` times the blocks alone instead (the lean runner's forward over [8, 500]
token ids against 8 forwards over [1, 500]: no head, no scheduler, no prefix cache).

    python benchmarks/score_pass_size.py [--rounds 12] [--dtype float32] [--blocks]

Prints each arm's seconds per round and the per-round ratio of the eight passes' time over the one's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from logprobe.engine.engine import Engine
from logprobe.engine.host.request import SamplingParams, SequenceGroup
from logprobe.engine.runners import loader
from logprobe.engine.runners.lean.attention import PassMeta

WORDS = ["river", "stone", "lamp", "garden", "winter", "letter", "harbour", "field", "clock", "bridge",
         "window", "forest", "road", "candle", "silver", "morning", "copper", "meadow", "tower", "salt"]


def text(salt: int, n: int) -> str:
    return " ".join(WORDS[(salt * 13 + j * (salt % 7 + 3)) % len(WORDS)] + str((salt + j) % 97) for j in range(n))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--blocks", action="store_true", help="the blocks alone: one forward of [8, 500] against 8 of [1, 500]")
    args = ap.parse_args()
    source = loader.resolve_source(None)
    model, tok = loader.load(source, dtype=args.dtype)
    engine = Engine(model, tok, source.name, source.aliases)
    salt = [0]

    def groups() -> list[SequenceGroup]:
        out = []
        for c in range(8):
            salt[0] += 1
            ids = tok(f"Record {90_000 + salt[0]}: " + text(90_000 + salt[0], 150)).input_ids[:500]
            out.append(SequenceGroup(f"s{c}", ids, SamplingParams(max_tokens=0, prompt_logprobs=1), engine.table))
        return out

    def engine_arm(budget: int) -> float:
        engine.scheduler.score_batch_tokens = budget
        batch = groups()
        t0 = time.perf_counter()
        asyncio.run(engine.run_groups(batch))
        return time.perf_counter() - t0

    runner = engine.runner
    gen = torch.Generator().manual_seed(0)

    def blocks_arm(budget: int) -> float:
        rows = 1 if budget == 512 else 8

        def one(b):
            masks, read = runner.attention.own_pass(500)
            meta = PassMeta(torch.arange(500)[None].expand(b, -1), masks, read=read)
            runner.forward(torch.randint(100, 40_000, (b, 500), generator=gen), meta)

        t0 = time.perf_counter()
        with torch.inference_mode():
            for _ in range(8 // rows):
                one(rows)
        return time.perf_counter() - t0

    if not args.blocks:
        engine.start()
    arm = blocks_arm if args.blocks else engine_arm
    arm(4096)  # warm-up
    times = {512: [], 4096: []}
    for r in range(args.rounds):
        for budget in ((512, 4096) if r % 2 else (4096, 512)):
            times[budget].append(arm(budget))
    if not args.blocks:
        engine.stop()
    what = "the blocks alone, [8, 500] ids" if args.blocks else "8 scoring requests of ~500 tokens, prompt_logprobs 1"
    print(f"{what}; bundled model, {args.dtype}, {torch.get_num_threads()} threads, {args.rounds} rounds alternating, "
          f"{time.strftime('%Y-%m-%d')}")
    print("8 passes s: " + ", ".join(f"{x:.2f}" for x in times[512]))
    print("1 pass s:   " + ", ".join(f"{x:.2f}" for x in times[4096]))
    ratios = [a / b for a, b in zip(times[512], times[4096])]
    print("8 passes / 1 pass per round: " + ", ".join(f"{q:.3f}" for q in ratios)
          + f" (median {statistics.median(ratios):.3f})")


if __name__ == "__main__":
    main()
