"""Constrained decoding's cost: 16 streams under a JSON schema against the same 16 streams without it, on
the bundled model in one process, in alternating rounds (the order flips every round), each stream 64
sampled tokens (seeded, temperature 1, logprobs 5). Also the schema's first compile for the model and
the grammar cache's counts after the run.

    python benchmarks/constrained.py [--rounds 4] [--max-tokens 64] [--dtype float32]

Prints tokens per second per arm and round, the median of the per-round ratios (constrained /
unconstrained; the target is >= 0.8) and the tokens each arm generated (a stream that ends early
generates fewer: the rate is what compares). These machines drift by up to 2x within minutes: read the
ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "summary": {"type": "string", "minLength": 150},  # long enough that no stream completes early
    "year": {"type": "integer"},
}, "required": ["title", "summary", "year"]}


def run_arm(engine, prompt_ids: list[int], constraint, max_tokens: int, salt: int) -> tuple[float, int]:
    """(tokens per second, tokens generated) of 16 streams at once."""
    from logprobe.backend import GenerationRequest, SamplingParams

    requests = [GenerationRequest(f"r{salt}-{i}", prompt_ids + [10 + i],
                                  SamplingParams(max_tokens=max_tokens, logprobs=5, seed=salt * 100 + i,
                                                 constraint=constraint))
                for i in range(16)]
    started = time.perf_counter()
    outputs = asyncio.run(engine.run(requests))
    seconds = time.perf_counter() - started
    generated = sum(out.num_generated for out in outputs)
    if constraint is not None:  # every finished stream's text is inside the schema
        for out in outputs:
            choice = out.choices[0]
            if choice.finish_reason == "stop":
                json.loads(choice.text)
    return generated / seconds, generated


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    from logprobe.backend import Constraint
    from logprobe.engine.host import grammar
    from logprobe.engine.runners import loader
    from logprobe.engine.engine import Engine

    source = loader.resolve_source(None)
    model, tok = loader.load(source, dtype=args.dtype)
    engine = Engine(model, tok, source.name, source.aliases)
    engine.start()
    constraint = Constraint("json_schema", json.dumps(SCHEMA, separators=(",", ":")))
    started = time.perf_counter()
    vocab = grammar.vocab_of_model(engine)
    vocab_seconds = time.perf_counter() - started
    compiled = grammar.grammar_for(constraint, vocab)
    print(f"{source.name}, {args.dtype}, {os.cpu_count()} CPUs, 16 streams x {args.max_tokens} tokens, "
          f"{args.rounds} alternating rounds")
    print(f"llguidance vocabulary built in {vocab_seconds * 1e3:.0f} ms; the schema compiled in "
          f"{compiled.compile_seconds * 1e3:.1f} ms (first time for this model)")
    prompt_ids = tok("Describe a book as JSON:").input_ids
    run_arm(engine, prompt_ids, None, 8, 0)  # warm-up
    run_arm(engine, prompt_ids, constraint, 8, 0)
    ratios, totals = [], {"unconstrained": 0, "constrained": 0}
    for r in range(1, args.rounds + 1):
        arms = [("unconstrained", None), ("constrained", constraint)]
        if r % 2 == 0:
            arms.reverse()
        rates = {}
        for name, arm_constraint in arms:
            rates[name], generated = run_arm(engine, prompt_ids, arm_constraint, args.max_tokens, r)
            totals[name] += generated
        ratios.append(rates["constrained"] / rates["unconstrained"])
        print(f"round {r}  unconstrained {rates['unconstrained']:7.1f} tok/s   constrained "
              f"{rates['constrained']:7.1f} tok/s   ratio {ratios[-1]:.3f}", flush=True)
    engine.stop()
    stats = grammar.cache_stats()
    print(f"median ratio {statistics.median(ratios):.3f} (rounds: {', '.join(f'{x:.3f}' for x in ratios)}); "
          f"tokens generated: unconstrained {totals['unconstrained']}, constrained {totals['constrained']}")
    print(f"grammar cache: {stats['misses']} compiles ({stats['compile_seconds'] * 1e3:.1f} ms in all), "
          f"{stats['hits']} hits (one per constrained stream)")


if __name__ == "__main__":
    main()
