"""The engine of this tree against another version's (the plain path: requests that ask for no instrument
and no intervention), in alternating rounds, each round a fresh process per side:

1. one stream: 64 greedy tokens with logprobs 5;
2. 16 streams at once: 64 sampled tokens each (seeded, temperature 1), logprobs 5;
3. scoring: 64 prompt-only texts of ~128 tokens, echo + logprobs 5, all submitted at once; the texts of
   every round and side are new (none repeats a prefix another ran), so a prefix cache only costs here.

    python benchmarks/engine_ab.py --baseline /path/to/other/checkout/src [--rounds 3]
                                   [--dtype bfloat16] [--quantization int4] [--context N]

`--context N` puts N tokens in front of the streams' prompt (their rows decode from N positions on)
and N words more in each scored text (long prompts, long key reads).

Prints tokens per second per side and round, and the median of the per-round ratios (this tree / the
baseline). These machines drift by up to 2x within minutes: read the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")

WORKER = r"""
import asyncio, json, sys, time
import torch
from logprobe.engine.engine import Engine
try:
    from logprobe.engine.runners import loader
    from logprobe.engine.host.request import SamplingParams, SequenceGroup
except ImportError:  # a tree from before engine/ was laid out by role (a baseline)
    from logprobe.engine import loader
    from logprobe.engine.request import SamplingParams, SequenceGroup

dtype, quantization, salt, context = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
source = loader.resolve_source(None)
model, tok = loader.load(source, dtype=dtype, quantization=quantization)
engine = Engine(model, tok, source.name, source.aliases)
engine.start()
words = ["river", "stone", "lamp", "garden", "winter", "letter", "harbour", "field", "clock", "bridge",
         "window", "forest", "road", "candle", "silver", "morning"]

def text(i):
    # distinct from its first token on, per round and side (salt), so no prefix repeats
    picks = [words[(i * 7 + j * (salt + 3) + salt) % len(words)] for j in range(120 + context)]
    return f"Text {salt}-{i}: " + " ".join(picks)

def run(groups):
    t0 = time.perf_counter()
    asyncio.run(engine.run_groups(groups))
    return time.perf_counter() - t0

prompt = tok("The history of the printing press").input_ids
if context:  # streams that start `context` tokens in
    prompt = tok(" ".join(words[(j * 5 + salt) % len(words)] for j in range(context))).input_ids[:context] + prompt
run([SequenceGroup("warm", prompt, SamplingParams(max_tokens=8, logprobs=5, temperature=0), engine.table)])
out = {}
t = run([SequenceGroup("one", prompt, SamplingParams(max_tokens=64, logprobs=5, temperature=0), engine.table)])
out["1 stream"] = 64 / t
groups = [SequenceGroup(f"s{i}", prompt + [i + 10], SamplingParams(max_tokens=64, logprobs=5, seed=i),
                        engine.table) for i in range(16)]
out["16 streams"] = 16 * 64 / run(groups)
texts = [tok(text(i)).input_ids for i in range(64)]
groups = [SequenceGroup(f"c{i}", ids, SamplingParams(max_tokens=0, echo=True, logprobs=5), engine.table)
          for i, ids in enumerate(texts)]
out["scoring"] = sum(len(ids) for ids in texts) / run(groups)
engine.stop()
print("RESULT " + json.dumps(out))
"""


def one_round(src: str, dtype: str, quantization: str, salt: int, context: int = 0) -> dict:
    env = {**os.environ, "PYTHONPATH": src}
    proc = subprocess.run([sys.executable, "-c", WORKER, dtype, quantization, str(salt), str(context)], env=env,
                          capture_output=True, text=True, check=True)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="the other version's src/ directory")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--quantization", default="int4", choices=["none", "int4"])
    ap.add_argument("--context", type=int, default=0,
                    help="tokens in front of the streams' prompt, and words added to each scored text")
    args = ap.parse_args()
    print(f"this tree ({HERE}) vs baseline ({args.baseline}); bundled model, {args.dtype}, "
          f"quantization {args.quantization}, context {args.context}, {os.cpu_count()} CPUs, "
          f"{args.rounds} alternating rounds")
    ratios: dict[str, list[float]] = {}
    salt = 0
    for r in range(args.rounds):
        sides = [("baseline", args.baseline), ("this tree", HERE)]
        if r % 2:
            sides.reverse()  # alternate which side runs first
        results = {}
        for name, src in sides:
            salt += 1
            results[name] = one_round(src, args.dtype, args.quantization, salt, args.context)
        for workload in results["baseline"]:
            old, new = results["baseline"][workload], results["this tree"][workload]
            ratios.setdefault(workload, []).append(new / old)
            print(f"round {r + 1}  {workload:11} baseline {old:8.1f} tok/s   this tree {new:8.1f} tok/s   "
                  f"ratio {new / old:.3f}", flush=True)
    for workload, values in ratios.items():
        print(f"{workload:11} median ratio {statistics.median(values):.3f} (rounds: "
              f"{', '.join(f'{v:.3f}' for v in values)})")


if __name__ == "__main__":
    main()
