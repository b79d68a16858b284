"""What same-bits bfloat16 and int4 products cost (docs/performance.md, "The same bits beside other
requests"): two ways to give a row the same bits whatever its call holds, timed against the bfloat16
product.

- bfloat16: oneDNN's pre-packed product takes another path for calls of 33-600 rows
  (benchmarks/row_invariance.py); run in pieces of 32 rows it would always take the 1-32 path. Printed:
  one call of M rows, then the same rows as pieces of 32, and their ratio.
- int4: the 4-bit kernel is row-invariant, so every decode row reads the 4-bit weights whatever the
  step holds (`--quantization int4`; a decode step of more than 8 rows once read the bfloat16 ones).
  Printed: the 4-bit kernel's time at the same M (decode row counts only), against the bfloat16
  product's, which the step would otherwise take.

Each product is timed alone, its weights in cache (a call repeated), the median of `--calls` calls.

    python benchmarks/invariant_product_costs.py [--threads 2] [--calls 20] [--hidden 576 --intermediate 1536
                                                  --qkv 960 --vocab 49152] [--rows 8,16,32,64,256,512]

The defaults are SmolLM2-135M's shapes.
"""

from __future__ import annotations

import argparse
import time

import torch

from logprobe.engine.runners.int4 import Grid, Int4Linear

ROWS = [8, 16, 32, 64, 256, 512]


def median_ms(call, calls: int) -> float:
    call()
    call()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--qkv", type=int, default=960)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts, comma-separated")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shapes = {"qkv": (args.qkv, args.hidden), "gate_up": (2 * args.intermediate, args.hidden),
              "down_proj": (args.hidden, args.intermediate), "head": (args.vocab, args.hidden)}
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.calls} calls (ms)")
    print("| product | rows | bf16, one call | bf16, pieces of 32 | pieces / one | int4 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, (n, k) in shapes.items():
        weight = torch.randn(n, k, generator=gen).bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)

        def bf16(x):
            return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

        four = None
        if name != "head":  # the head has no 4-bit form
            q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
            four = Int4Linear([Grid(q, torch.rand(n, k // 32, generator=gen) * 0.01,
                                    -torch.rand(n, k // 32, generator=gen) * 0.05)])
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen).bfloat16()
            whole = median_ms(lambda: bf16(x), args.calls)
            pieces = median_ms(lambda: torch.cat([bf16(c) for c in x.split(32)]), args.calls)
            int4 = f"{median_ms(lambda: four(x), args.calls):.2f}" if four is not None and rows <= 64 else ""
            print(f"| {name} | {rows} | {whole:.2f} | {pieces:.2f} | {pieces / whole:.2f} | {int4} |", flush=True)


if __name__ == "__main__":
    main()
