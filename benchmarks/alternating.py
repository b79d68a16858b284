"""Alternating rounds of a benchmark's worker (client_loop.py, mixed_load.py): this tree against another
version's src/ (`--baseline`), each side a fresh process per round, the worker's last line its JSON."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def parser(doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="another version's src/ directory, measured in alternating rounds")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    return ap


def rounds(worker: str, args, *worker_args) -> dict[str, list[dict]]:
    """{side: [the worker's JSON per round]}: the worker runs with `args.dtype` and `worker_args`."""
    sides = [("this tree", HERE)] + ([("baseline", args.baseline)] if args.baseline else [])
    results = {name: [] for name, _ in sides}
    for _ in range(args.rounds):
        for name, src in sides:
            done = subprocess.run([sys.executable, "-c", worker, args.dtype, *map(str, worker_args)],
                                  env={**os.environ, "PYTHONPATH": src}, capture_output=True, text=True, check=True)
            results[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    return results
