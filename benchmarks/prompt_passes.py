"""Prompt-only pass sizes A/B: the in-process dataset job (datasets/job.py's chunks on an InProcessScorer)
with the scheduler's prompt-only pass cap and the head's positions per run set per arm, on one engine.

The arms take turns, in an order that alternates between rounds (this machine's speed drifts); printed are
each arm's median tokens per second and the median per-round ratio to the first arm. Arms are
`rows_cap:head_positions` pairs, e.g. `64:256` (a server engine's pass cap, the head's default positions
per run) against `1024:256` (the dataset scorer's cap, datasets/scorer.PASS_ROWS). Each arm scores rows of
its own (the same mix of lengths), as rows another arm scored would find their blocks in the prefix cache.

`--passes` times the passes alone instead (the blocks and the head's target log probabilities, no job):
a length class of N rows of T tokens as passes of 64 rows against one pass of up to 4,096 tokens, the
two in alternating order, and prints the 64-row passes' time over the one pass's, per round.

    python benchmarks/prompt_passes.py [--rows 700] [--rounds 6] [--dtype float32|bfloat16]
                                       [--arms 64:256 1024:256 1024:1024] [--passes]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from score_dataset import make_rows  # noqa: E402  (benchmarks/score_dataset.py)


def score_once(scorer, texts: list[str]) -> tuple[int, float]:
    """Tokens scored and seconds: prepared rows in the job's chunks, the job's chunks in flight."""
    from logprobe.datasets import job
    from logprobe.datasets.io import Row

    prepared = scorer.prepare([Row(i, str(i), t, None) for i, t in enumerate(texts)])
    tokens = []
    started = time.perf_counter()
    job.run_sync(job.score_chunks(scorer, job.chunks(prepared),
                                  lambda chunk, records: tokens.extend(r["num_tokens"] for r in records)))
    return sum(tokens), time.perf_counter() - started


def one_pass(runner, rows: int, tokens: int) -> None:
    """One right-padded pass of `rows` random prompts of `tokens` tokens, every position through the head."""
    import torch
    from logprobe.engine.runners.lean.attention import PassMeta
    from logprobe.engine.host.request import SamplingParams

    ids = torch.randint(100, 40_000, (rows, tokens))
    masks, read = runner.attention.own_pass(tokens)
    meta = PassMeta(torch.arange(tokens)[None].expand(rows, -1), masks, read=read)
    hidden = runner.forward(ids, meta)
    states = hidden[:, :tokens - 1].reshape(-1, hidden.shape[-1])
    cols = runner.columns.new(1 + states.shape[0], SamplingParams(prompt_logprobs=0))
    runner.columns.fill(cols, states, ids.reshape(-1)[:states.shape[0] + 1], 0)


def passes_alone(runner, rounds: int, budget: int = 4096) -> None:
    """Narrow (64-row) passes against one wide pass per length class, the time ratio per round."""
    import torch

    classes = [(200, 4), (200, 6), (200, 9), (140, 16), (140, 29)]  # (rows, tokens)
    ratios: dict[tuple, list[float]] = {c: [] for c in classes}
    with torch.inference_mode():
        one_pass(runner, 64, 8)  # warm-up
        for round_number in range(rounds):
            for rows, tokens in classes:
                wide = min(rows, budget // tokens)
                arms = {"narrow": [64] * (rows // 64) + [rows % 64], "wide": [wide] * (rows // wide)}
                seconds = {}
                for name in arms if round_number % 2 == 0 else reversed(list(arms)):
                    started = time.perf_counter()
                    for size in filter(None, arms[name]):
                        one_pass(runner, size, tokens)
                    seconds[name] = time.perf_counter() - started
                ratios[(rows, tokens)].append(seconds["narrow"] / seconds["wide"])
    for (rows, tokens), values in ratios.items():
        print(f"  {rows} rows x {tokens} tokens: 64-row passes take {statistics.median(values):.2f}x one pass "
              f"(rounds {', '.join(f'{r:.2f}' for r in values)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=700)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--arms", nargs="+", default=["64:256", "1024:256"])
    ap.add_argument("--passes", action="store_true", help="time the passes alone (no job)")
    args = ap.parse_args()

    import torch
    from logprobe.datasets.scorer import InProcessScorer

    arms = [tuple(int(x) for x in arm.split(":")) for arm in args.arms]
    print(f"conditions: {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, {args.dtype}, "
          f"{args.rows} rows a round, {args.rounds} rounds, load average {os.getloadavg()[0]:.1f}, "
          f"{time.strftime('%Y-%m-%d')}", flush=True)
    scorer = InProcessScorer.from_model(dtype=args.dtype)
    engine = scorer.engine
    rates: dict[tuple, list[float]] = {arm: [] for arm in arms}
    if args.passes:
        try:
            return passes_alone(engine.runner, args.rounds)
        finally:
            scorer.close()
    try:
        score_once(scorer, make_rows(64, salt=1))  # warm-up
        for round_number in range(args.rounds):
            for arm in arms if round_number % 2 == 0 else list(reversed(arms)):
                texts = make_rows(args.rows, salt=2000 + 100 * round_number + arms.index(arm))
                engine.scheduler.max_score_batch, engine.runner.columns.chunk_positions = arm
                tokens, wall = score_once(scorer, texts)
                rates[arm].append(tokens / wall)
                print(f"  round {round_number + 1} {arm}: {tokens} tokens in {wall:6.2f} s = "
                      f"{tokens / wall:7.1f} tok/s", flush=True)
    finally:
        scorer.close()
    base = rates[arms[0]]
    for arm, values in rates.items():
        ratios = [v / b for v, b in zip(values, base)]
        print(f"  {arm}: {statistics.median(values):7.1f} tok/s, {statistics.median(ratios):.3f}x {arms[0]} "
              f"(rounds {', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
