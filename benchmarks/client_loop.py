"""A client that picks every token itself (seed 004's "custom token heuristics"): one request per token,
`prompt` = the token ids so far, `max_tokens` 1, `logprobs` 5, the next prompt its prompt plus the token
picked. Measured per call after the first, at several lengths of context, against the engine's own
decode step per token at the same length (a 32-token greedy generation from the same context: its time
after the first token, per token). Each side of an A/B runs in a fresh process, rounds alternating.

    python benchmarks/client_loop.py [--baseline /path/to/other/checkout/src] [--rounds 3]
                                     [--contexts 100,500,2000] [--calls 32] [--dtype float32]

Prints, per side and context: milliseconds per call (median of the calls after the first), the decode
step, their ratio, and the prefix cache's counters after the loop. The engine runs in-process (no HTTP:
the server adds the same few milliseconds to both).
"""

from __future__ import annotations

import statistics

import alternating

WORKER = r"""
import asyncio, json, statistics, sys, time
import torch
from logprobe.engine.engine import Engine
try:
    from logprobe.engine.runners import loader
    from logprobe.engine.host.request import SamplingParams, SequenceGroup
except ImportError:  # a tree from before engine/ was laid out by role (a baseline)
    from logprobe.engine import loader
    from logprobe.engine.request import SamplingParams, SequenceGroup

dtype, contexts, calls = sys.argv[1], [int(c) for c in sys.argv[2].split(",")], int(sys.argv[3])
source = loader.resolve_source(None)
model, tok = loader.load(source, dtype=dtype)
engine = Engine(model, tok, source.name, source.aliases)
engine.start()
words = ["river", "stone", "lamp", "garden", "winter", "letter", "harbour", "field", "clock", "bridge",
         "window", "forest", "road", "candle", "silver", "morning"]
base = tok(" ".join(words[(i * 7) % 16] for i in range(3000))).input_ids

def one(prompt, max_tokens, k=5):
    group = SequenceGroup("loop", list(prompt), SamplingParams(max_tokens=max_tokens, logprobs=k), engine.table)
    t0 = time.perf_counter()
    asyncio.run(engine.run_groups([group]))
    return time.perf_counter() - t0, group

def cache_stats():
    stats = engine.stats()
    return {k: stats.get(k, 0) for k in ("prefix_cache_bytes", "prefix_cache_hits", "prefix_cache_misses",
                                         "prefix_cache_tokens_saved")}

one(base[:64], 4)  # warm-up
out = {}
for n in contexts:
    prompt = [(t + n) % 40000 for t in base[:n]]  # its own tokens per context: no prefix of another
    per_call = []
    for c in range(calls):
        seconds, group = one(prompt, 1)
        if c:
            per_call.append(seconds)
        prompt = prompt + [group.sequences[0].token_ids[0]]
    # the decode step at this length: 32 greedy tokens, the time after the first, per token
    t_first, _ = one(prompt[:-1] + [7], 1)
    t_all, group = one(prompt[:-1] + [7], 33)
    step = (t_all - t_first) / 32
    out[n] = {"call_ms": 1e3 * statistics.median(per_call), "step_ms": 1e3 * step, **cache_stats()}
engine.stop()
print(json.dumps(out))
"""


def main() -> None:
    ap = alternating.parser(__doc__)
    ap.add_argument("--contexts", default="100,500,2000")
    ap.add_argument("--calls", type=int, default=32)
    args = ap.parse_args()
    results = alternating.rounds(WORKER, args, args.contexts, args.calls)
    print(f"client loop: {args.calls} calls of max_tokens 1, logprobs 5 per context; bundled model, {args.dtype}, "
          f"{args.rounds} rounds alternating")
    print("| side | context | ms per call (median per round) | decode step ms | call / step | prefix cache "
          "hits / misses / tokens saved / MB (last round) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, rounds in results.items():
        for n in args.contexts.split(","):
            calls = [r[n]["call_ms"] for r in rounds]
            steps = [r[n]["step_ms"] for r in rounds]
            ratios = [c / s for c, s in zip(calls, steps)]
            last = rounds[-1][n]
            print(f"| {name} | {n} | {', '.join(f'{c:.0f}' for c in calls)} | {', '.join(f'{s:.0f}' for s in steps)} "
                  f"| {statistics.median(ratios):.2f}x | {last['prefix_cache_hits']} / {last['prefix_cache_misses']} / "
                  f"{last['prefix_cache_tokens_saved']} / {last['prefix_cache_bytes'] / 2**20:.1f} |")


if __name__ == "__main__":
    main()
