"""A multiple-choice evaluation as lm-evaluation-harness runs one (docs/performance.md, "One context, many
continuations"): each question is a context of about 95 tokens and 4 answers; each (context, answer)
pair is a prompt-only request for the answer's log-likelihood, the 4 of a question sent together (as
`/v1/score` with one `context` and 4 `input`s sends them). Measured in one process on the bundled model:
the engine as it runs (prompts of one batch that share their first tokens share that prefix's pass)
against the same engine with sharing turned off, in alternating rounds; tokens run through the blocks
(real and padded) and wall time for all questions, and the largest difference between the two's log
probabilities.

    python benchmarks/multiple_choice.py [--questions 24] [--rounds 3] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from logprobe.engine import loader  # noqa: E402
from logprobe.engine.engine import Engine  # noqa: E402
from logprobe.engine.fast_runner import shared_prefixes  # noqa: E402
from logprobe.engine.request import SamplingParams, SequenceGroup  # noqa: E402

SUBJECTS = ["the river", "the old library", "a mountain village", "the harbour", "the northern forest",
            "a small bakery", "the observatory", "the railway station"]
ANSWERS = [" because the water rose", " the keeper of the key", " in the early spring of that year",
           " nobody", " a letter from her brother", " the bells", " twelve", " it was never found again"]


def questions(tokenizer, count: int) -> list[tuple[list[int], list[list[int]]]]:
    out = []
    for q in range(count):
        subject = SUBJECTS[q % len(SUBJECTS)]
        text = (f"Passage {q}: The story of {subject} begins long ago, when travellers first stopped there on "
                f"their way to the coast. Over the years it changed hands many times, and each owner left "
                f"something behind: a door, a name, a habit that the next owner kept without knowing why. "
                f"People who live nearby still tell the story of the winter when everything stopped.\n"
                f"Question {q}: What happened to {subject} in that winter?\nAnswer:")
        context = tokenizer(text).input_ids
        answers = [tokenizer(ANSWERS[(q + j) % len(ANSWERS)], add_special_tokens=False).input_ids for j in range(4)]
        out.append((context, answers))
    return out


def run(engine, items) -> tuple[float, list[np.ndarray]]:
    logprobs = []

    async def main():
        for context, answers in items:
            groups = [SequenceGroup("mc", context + a, SamplingParams(max_tokens=0, prompt_logprobs=1), engine.table)
                      for a in answers]
            await engine.run_groups(groups)
            logprobs.extend(g.prompt_columns.logprobs[len(context):] for g in groups)

    t0 = time.perf_counter()
    asyncio.run(main())
    return time.perf_counter() - t0, logprobs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--questions", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    model, tokenizer = loader.load(loader.resolve_source(None), dtype=args.dtype)
    engine = Engine(model, tokenizer, "smollm2-135m", [])
    runner = engine.runner
    counted = {"real": 0, "padded": 0}
    original = runner._run

    def counting(ids, positions, attend, **kwargs):
        counted["padded"] += ids.numel()
        return original(ids, positions, attend, **kwargs)

    runner._run = counting
    items = questions(tokenizer, args.questions)
    engine.start()
    try:
        run(engine, items[:2])  # warm-up
        times = {"shared": [], "separate": []}
        tokens, answers = {}, {}
        for _ in range(args.rounds):
            for mode in ("shared", "separate"):
                if mode == "separate":
                    runner.SHARED_PREFIX_MIN = 10**9
                counted["padded"] = 0
                seconds, logprobs = run(engine, items)
                if mode == "separate":
                    del runner.SHARED_PREFIX_MIN
                times[mode].append(seconds)
                tokens[mode] = counted["padded"]
                answers[mode] = logprobs
    finally:
        engine.stop()
    real_separate = sum(len(c) + len(a) for c, ans in items for a in ans)
    real_shared = 0
    for c, ans in items:
        prompts = [c + a for a in ans]
        (prefix, _), = shared_prefixes(prompts, runner.SHARED_PREFIX_MIN)
        real_shared += prefix + sum(len(p) - prefix for p in prompts)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(answers["shared"], answers["separate"]))
    ratios = [s / t for s, t in zip(times["separate"], times["shared"])]
    print(f"{args.questions} questions x 4 answers, bundled model, {args.dtype}, {torch.get_num_threads()} threads, "
          f"{time.strftime('%Y-%m-%d')}")
    print("| | tokens through the blocks (real / with padding) | seconds per round | ")
    print("| --- | --- | --- |")
    print(f"| one pass per prompt | {real_separate:,} / {tokens['separate']:,} | "
          f"{', '.join(f'{t:.2f}' for t in times['separate'])} |")
    print(f"| shared context | {real_shared:,} / {tokens['shared']:,} | {', '.join(f'{t:.2f}' for t in times['shared'])} |")
    print(f"speed-up per round (alternating): {', '.join(f'{r:.2f}x' for r in ratios)}, median "
          f"{statistics.median(ratios):.2f}x; largest log probability difference {diff:.1e}")


if __name__ == "__main__":
    main()
