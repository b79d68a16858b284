"""The batched sampler of this tree against another version's: one decode step's draw (`sample_batch`,
settings moved to the device included) for batches of sampled rows over the bundled model's vocabulary
(49,152), in alternating rounds, each round a fresh process per side.

    python benchmarks/sampler_ab.py --baseline /path/to/other/checkout/src [--rounds 3] [--vocab 49152]

Prints milliseconds per draw per side, batch and round, and the median of the per-round ratios (this
tree / the baseline). Read the ratios: these machines drift by up to 2x within minutes.
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
import json, statistics, sys, time
import torch
from logprobe.backend import SamplingParams
try:
    from logprobe.engine.device.sampler import BatchSettings, sample_batch
    from logprobe.engine.host.random_streams import Stream
except ImportError:  # a tree from before engine/ was laid out by role (a baseline)
    from logprobe.engine.sampler import BatchSettings, sample_batch
    from logprobe.engine.random_streams import Stream

vocab, salt = int(sys.argv[1]), int(sys.argv[2])
gen = torch.Generator().manual_seed(salt)
out = {}
for rows in (1, 16, 64):
    lsm = torch.log_softmax(torch.randn(rows, vocab, generator=gen) * 3, dim=-1)
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(rows)]
    times = []
    for step in range(25):
        seeds = [Stream(i, 0).seed(step) for i in range(rows)]
        t0 = time.perf_counter()
        sample_batch(lsm, BatchSettings.of(params, vocab, lsm.device, seeds))
        times.append(time.perf_counter() - t0)
    out[f"{rows} rows"] = statistics.median(times[5:]) * 1e3
print("RESULT " + json.dumps(out))
"""


def one_round(src: str, vocab: int, salt: int) -> dict:
    env = {**os.environ, "PYTHONPATH": src}
    proc = subprocess.run([sys.executable, "-c", WORKER, str(vocab), str(salt)], env=env, capture_output=True,
                          text=True, check=True)
    return json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="the other version's src/ directory")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=49_152)
    args = ap.parse_args()
    print(f"this tree ({HERE}) vs baseline ({args.baseline}); vocabulary {args.vocab}, temperature 1, "
          f"{os.cpu_count()} CPUs, torch threads default, {args.rounds} alternating rounds")
    ratios: dict[str, list[float]] = {}
    for r in range(args.rounds):
        sides = [("baseline", args.baseline), ("this tree", HERE)]
        if r % 2:
            sides.reverse()
        results = {name: one_round(src, args.vocab, r) for name, src in sides}
        for batch in results["baseline"]:
            old, new = results["baseline"][batch], results["this tree"][batch]
            ratios.setdefault(batch, []).append(new / old)
            print(f"round {r + 1}  {batch:8} baseline {old:7.2f} ms   this tree {new:7.2f} ms   ratio {new / old:.3f}",
                  flush=True)
    for batch, values in ratios.items():
        rounds = ", ".join(f"{v:.3f}" for v in values)
        print(f"{batch:8} median ratio {statistics.median(values):.3f} (rounds: {rounds})")


if __name__ == "__main__":
    main()
