"""A multiple-choice evaluation as lm-evaluation-harness runs one (docs/performance.md, "One context, many
continuations"): each question is a context of about 95 tokens and 4 answers; each (context, answer)
pair is a prompt-only request for the answer's log-likelihood. Measured in one process on the bundled
model, in alternating rounds; tokens run through the blocks (real and padded), wall time for all
questions, and the largest difference between the arms' log probabilities:

* the 4 answers of a question sent together (as `/v1/score` with one `context` and 4 `input`s sends
  them): the engine as it runs (prompts of one batch that share their first tokens share that prefix's
  pass) against the same engine with sharing turned off (the prefix cache off in both);
* the answers in separate batches, one request each, longest first (as lm-evaluation-harness's length
  sorting sends them, so a question's answers are far apart): the prefix cache (engine/runners/prefix_cache.py,
  emptied before each round) on against off;
* the context first in a generation request (`max_tokens` 1, as a harness that generates before it
  scores, or a client whose context arrives in generation calls), then the 4 answers one by one: the
  prefix cache on (the generation's prompt keeps its blocks and hidden states) against off.

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

from logprobe.engine.runners import loader  # noqa: E402
from logprobe.engine.engine import Engine  # noqa: E402
from logprobe.engine.runners.lean import shared_prefixes  # noqa: E402
from logprobe.engine.runners.prefix_cache import PrefixCache  # noqa: E402
from logprobe.engine.host.request import SamplingParams, SequenceGroup  # noqa: E402

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


def run_sorted(engine, items) -> tuple[float, list[np.ndarray]]:
    """Every (context, answer) request alone, longest first (ties in question order): log probabilities in
    the order `run` gives them."""
    order = sorted(((q, j) for q, (_, answers) in enumerate(items) for j in range(len(answers))),
                   key=lambda qj: -(len(items[qj[0]][0]) + len(items[qj[0]][1][qj[1]])))
    found = {}

    async def main():
        for q, j in order:
            context, answers = items[q]
            group = SequenceGroup("mc", context + answers[j], SamplingParams(max_tokens=0, prompt_logprobs=1),
                                  engine.table)
            await engine.run_groups([group])
            found[q, j] = group.prompt_columns.logprobs[len(context):]

    t0 = time.perf_counter()
    asyncio.run(main())
    return time.perf_counter() - t0, [found[q, j] for q, (_, ans) in enumerate(items) for j in range(len(ans))]


def run_after_generation(engine, items) -> tuple[float, list[np.ndarray]]:
    """Per question: the context as a one-token generation request, then each answer as a request of its
    own; log probabilities in the order `run` gives them."""
    logprobs = []

    async def main():
        for context, answers in items:
            await engine.run_groups([SequenceGroup("gen", context, SamplingParams(max_tokens=1, temperature=0),
                                                   engine.table)])
            for a in answers:
                group = SequenceGroup("mc", context + a, SamplingParams(max_tokens=0, prompt_logprobs=1), engine.table)
                await engine.run_groups([group])
                logprobs.append(group.prompt_columns.logprobs[len(context):])

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
    original = runner._embed  # every pass of the blocks begins here (`forward`, `forward_steps`)

    def counting(ids, meta, *args, **kwargs):
        counted["padded"] += ids.numel()
        return original(ids, meta, *args, **kwargs)

    runner._embed = counting
    items = questions(tokenizer, args.questions)
    cache, off = runner.prefix_cache, PrefixCache(0)
    modes = ("shared", "separate", "cached", "uncached", "generated", "generated-off")
    engine.start()
    try:
        engine.use_prefix_cache(off)
        run(engine, items[:2])  # warm-up
        run_sorted(engine, items[:2])
        times = {mode: [] for mode in modes}
        tokens, answers = {}, {}
        for _ in range(args.rounds):
            for mode in modes:
                engine.use_prefix_cache(cache if mode in ("cached", "generated") else off)
                cache.clear()
                if mode == "separate":
                    runner.prompt_batches.SHARED_PREFIX_MIN = 10**9
                counted["padded"] = 0
                arm = {"shared": run, "separate": run, "generated": run_after_generation,
                       "generated-off": run_after_generation}.get(mode, run_sorted)
                seconds, logprobs = arm(engine, items)
                if mode == "separate":
                    del runner.prompt_batches.SHARED_PREFIX_MIN
                times[mode].append(seconds)
                tokens[mode] = counted["padded"]
                answers[mode] = logprobs
                if mode == "cached":
                    kept = (len(cache), cache.nbytes)
    finally:
        engine.stop()
    real_separate = sum(len(c) + len(a) for c, ans in items for a in ans)
    real_shared = 0
    for c, ans in items:
        prompts = [c + a for a in ans]
        (prefix, _), = shared_prefixes(prompts, runner.prompt_batches.SHARED_PREFIX_MIN)
        real_shared += prefix + sum(len(p) - prefix for p in prompts)
    def largest(a, b):
        return max(float(np.abs(x - y).max()) for x, y in zip(answers[a], answers[b]))

    diff = largest("shared", "separate")
    ratios = [s / t for s, t in zip(times["separate"], times["shared"])]
    cache_ratios = [s / t for s, t in zip(times["uncached"], times["cached"])]
    print(f"{args.questions} questions x 4 answers, bundled model, {args.dtype}, {torch.get_num_threads()} threads, "
          f"{time.strftime('%Y-%m-%d')}")
    print("| | tokens through the blocks (real / with padding) | seconds per round | ")
    print("| --- | --- | --- |")
    print(f"| one pass per prompt | {real_separate:,} / {tokens['separate']:,} | "
          f"{', '.join(f'{t:.2f}' for t in times['separate'])} |")
    print(f"| shared context | {real_shared:,} / {tokens['shared']:,} | {', '.join(f'{t:.2f}' for t in times['shared'])} |")
    print(f"speed-up per round (alternating): {', '.join(f'{r:.2f}x' for r in ratios)}, median "
          f"{statistics.median(ratios):.2f}x; largest log probability difference {diff:.1e}")
    print()
    print("answers in separate batches, longest first (one request per batch):")
    print("| | tokens through the blocks | seconds per round |")
    print("| --- | --- | --- |")
    for mode, name in (("uncached", "prefix cache off"), ("cached", "prefix cache on")):
        print(f"| {name} | {tokens[mode]:,} | {', '.join(f'{t:.2f}' for t in times[mode])} |")
    print(f"speed-up per round (alternating): {', '.join(f'{r:.2f}x' for r in cache_ratios)}, median "
          f"{statistics.median(cache_ratios):.2f}x; cache hits {cache.hits} of {cache.hits + cache.misses} "
          f"lookups over all rounds, {kept[0]} entries and {kept[1] / 2**20:.1f} MB held after a round; largest "
          f"log probability difference {largest('cached', 'uncached'):.1e} (cache on against off), "
          f"{largest('cached', 'shared'):.1e} (against the answers sent together)")
    gen_ratios = [s / t for s, t in zip(times["generated-off"], times["generated"])]
    print()
    print("the context first in a one-token generation request, then the answers one by one:")
    print("| | tokens through the blocks | seconds per round |")
    print("| --- | --- | --- |")
    for mode, name in (("generated-off", "prefix cache off"), ("generated", "prefix cache on")):
        print(f"| {name} | {tokens[mode]:,} | {', '.join(f'{t:.2f}' for t in times[mode])} |")
    print(f"speed-up per round (alternating): {', '.join(f'{r:.2f}x' for r in gen_ratios)}, median "
          f"{statistics.median(gen_ratios):.2f}x; largest log probability difference "
          f"{largest('generated', 'generated-off'):.1e} (cache on against off)")


if __name__ == "__main__":
    main()
