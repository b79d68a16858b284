"""One pass per step against two: a step of R decoding rows and a prompt chunk of C tokens, run as one pass
of the blocks and the head (`LeanRunner.decode_with_prefill`) or as a decode pass and a prefill pass (the
same runner with that method answering None). The engine is driven a step at a time on this thread, in
one process; the arms alternate step by step, each timing its own steps (the median of `--steps`).

    python benchmarks/one_pass.py [--rows 16] [--chunks 1,16,128,512] [--steps 12] [--dtype float32]
                                  [--quantization none|int4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from logprobe.engine.engine import Engine  # noqa: E402
from logprobe.engine.host.request import SamplingParams, SequenceGroup  # noqa: E402
from logprobe.engine.runners import loader  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--chunks", default="1,16,128,512")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--quantization", default="none", choices=["none", "int4"])
    args = ap.parse_args()
    source = loader.resolve_source(None)
    model, tok = loader.load(source, dtype=args.dtype, quantization=args.quantization)
    engine = Engine(model, tok, source.name, source.aliases, prefix_cache_mb=0)
    runner, scheduler = engine.runner, engine.scheduler
    merged = runner.decode_with_prefill
    gen = np.random.default_rng(0)

    def ids(n):
        return [1] + [int(t) for t in gen.integers(100, 40_000, n - 1)]

    rows = [SequenceGroup(f"r{i}", ids(64), SamplingParams(max_tokens=10_000, temperature=0), engine.table)
            for i in range(args.rows)]
    for g in rows:
        scheduler.add(g)
    while scheduler.prefilling or scheduler.waiting:  # every row decoding
        engine.step(scheduler.schedule())
    print(f"{args.rows} rows decoding (64-token prompts) beside a prompt chunk; bundled model, {args.dtype}, "
          f"quantization {args.quantization}, {torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')}")
    print("| chunk tokens | one pass ms (median) | two passes ms (median) | two / one |")
    print("| --- | --- | --- | --- |")
    with torch.inference_mode():
        for c in [int(x) for x in args.chunks.split(",")]:
            times = {"one": [], "two": []}
            for step in range(2 * args.steps):
                arm = "one" if step % 2 == 0 else "two"
                runner.decode_with_prefill = merged if arm == "one" else (lambda groups, chunks: None)
                g = SequenceGroup("p", ids(c), SamplingParams(max_tokens=1, temperature=0), engine.table)
                scheduler.prefill_chunk_tokens = c  # the whole prompt in this step's chunk
                scheduler.add(g)
                plan = scheduler.schedule()
                assert plan.decode and len(plan.prefill) == 1
                t0 = time.perf_counter()
                engine.step(plan)
                times[arm].append(time.perf_counter() - t0)
            one, two = statistics.median(times["one"]), statistics.median(times["two"])
            print(f"| {c} | {1e3 * one:.0f} | {1e3 * two:.0f} | {two / one:.2f}x |")
    runner.decode_with_prefill = merged


if __name__ == "__main__":
    main()
