"""The GPU check (docs/performance.md, "On a GPU"): one script, a few minutes, for a GPU machine without
a network. Prints a table and writes it as JSON (`--out`).

1. Ceilings of this GPU, measured here: device-to-device copy bandwidth and a bfloat16 matrix product.
2. Correctness on the device: tiny random-weight models of each family of the lean runner (and one
   transformers-forward model) run through logprobe's Engine on the GPU in float32, prompt and
   generated log probabilities checked against a float64 forward of transformers' own implementation
   on the CPU; the same in bfloat16 with its error reported. The sampler's random numbers: the same
   SplitMix64 bits on the device as on the CPU, and seeded float32 generations compared token by token.
   The newer decode paths on the same tiny float32 Llama, on the device against the CPU engine (the same
   tokens exactly, every number within 1e-4) and against float64: greedy under a JSON schema with
   `constraint_logprobs` (llguidance's masks on the grammar thread), seeded draws under logit_bias and
   bad words (`logprobs_mode: "both"`), a token tree, batch scoring lines held at a block of their
   pass while interactive requests run there (their numbers as uninterrupted and as alone), a client
   loop on the prefix cache (a request a token, each a hit), and a stream's prompt run at a block of
   an interactive scoring pass. The same bits beside other requests: tiny float32 Llama and Gemma 3
   models on the device, with the prefix cache and without, a scored text and three generations alone
   and then beside 1, 15 and 63 requests of every kind, every number compared bit for bit.
3. A Llama-3.1-8B-shaped model with random weights in bfloat16 (32 layers, d_model 4096, 32 query and 8
   key/value heads, MLP 14,336, vocabulary 128,256), loaded straight onto the device:
   - prefill tok/s (4 prompts of 2,048 tokens, one token generated each) against the FLOP ceiling,
   - decode tok/s at batch 1, 16 and 64 with logprobs 5 against the bandwidth ceiling (a step reads
     every weight once: 16.1 GB), with CUDA graphs and without, with the tokens picked in the graph
     and after it, and at batch 64 with top-p (picked after the replay, with a sort), the step's wall
     time beside the time the device's kernels run (the profiler) and the device-to-host
     synchronizations per decode step (CUDA's sync debug mode),
   - the same bits beside 15 and 63 requests of every kind, in bfloat16 at this shape, with each
     run's seconds,
   - a 256-position whole-vocabulary request (`prompt_logprobs: -1`, `vocab_encoding: "float32"`)
     end to end through the HTTP application (FastAPI's test client, in process),
   - decode at batch 1, 16 and 64 again with the fixed-shape step compiled by torch.compile (Inductor
     fuses each block's small kernels; `FixedShapeSteps.compile_step`, off by default): the first step's
     time (compiling) and each arm's ratio to the uncompiled one (skipped past 5 minutes of compiling).

The GPU image has torch and transformers but not FastAPI, Starlette, pydantic, uvicorn, orjson or
gguf: carry them as wheels (docs/development.md, "The GPU check"). The tokenizer is the bundled
model's (`--tokenizer DIR`: any transformers tokenizer directory; its 49,152 tokens name the 8B-shaped
model's first ids, the rest decode to nothing).

    python benchmarks/gpu_check.py --tokenizer DIR [--out gpu_check.json] [--device cuda] [--small]
                                   [--skip families,sampler,paths,invariance,whole,compile]

`--small` shrinks the large model (for a dry run of the script on a CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sys
import time
import traceback
import warnings

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "src"), os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "model")]

from logprobe.engine.runners.lean import fixed_shape  # noqa: E402
from logprobe.engine.engine import Engine  # noqa: E402
from logprobe.engine.host.request import SamplingParams, SequenceGroup  # noqa: E402

RESULTS: dict = {}
OUT: list[str] = []  # the JSON file, rewritten after every section (a run cut short keeps what it measured)


def say(*parts):
    print(*parts, flush=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write():
    if OUT:
        with open(OUT[0], "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


def section(name):
    def wrap(fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            say(f"\n== {name}")
            try:
                RESULTS[name] = fn(*args, **kwargs)
            except Exception as exc:  # one broken section does not hide the others' numbers
                traceback.print_exc()
                RESULTS[name] = {"error": f"{type(exc).__name__}: {exc}"}
            say(f"   ({time.perf_counter() - t0:.1f} s)")
            write()
            return RESULTS[name]
        return run
    return wrap


# ---- 1. ceilings -------------------------------------------------------------------------------
@section("ceilings")
def ceilings(device):
    if device.type != "cuda":
        return {"note": "not a GPU"}
    out = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__}
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device=device)  # 2 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    sync(device)
    out["copy_TBps"] = 10 * 2 * src.numel() / (start.elapsed_time(end) / 1e3) / 1e12  # read + write
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    sync(device)
    out["bf16_TFLOPs"] = 10 * 2 * 8192**3 / (start.elapsed_time(end) / 1e3) / 1e12
    say(f"   {out['gpu']}: copy {out['copy_TBps']:.2f} TB/s, bf16 matmul {out['bf16_TFLOPs']:.0f} TFLOP/s")
    return out


# ---- 2. correctness on the device --------------------------------------------------------------
def run_groups(engine, groups):
    asyncio.run(engine.run_groups(groups))
    return groups


@torch.inference_mode()
def reference_rows(model64, ids):
    logits = model64(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1).numpy()


@section("families on the device against float64")
def families(device, tokenizer):
    from test_families import build

    out = {}
    vocab = len(tokenizer)
    prompts = ["The quick brown fox jumps over the lazy dog and keeps running far away",
               "One two three four five six seven eight nine ten eleven twelve thirteen fourteen"]
    for kind in ["llama", "mistral", "qwen2", "gemma3", "qwen3", "phi3", "gpt2"]:
        model = build(kind, vocab)
        model64 = __import__("copy").deepcopy(model).double()
        for dtype in (torch.float32, torch.bfloat16):
            name = f"{kind}/{str(dtype).replace('torch.', '')}"
            try:
                m = __import__("copy").deepcopy(model).to(device=device, dtype=dtype)
                engine = Engine(m, tokenizer, name, [])
                engine.start()
                try:
                    groups = [SequenceGroup(f"g{i}", tokenizer(p).input_ids,
                                            SamplingParams(max_tokens=12, n=2, temperature=1.0, seed=i, logprobs=5,
                                                           prompt_logprobs=5), engine.table)
                              for i, p in enumerate(prompts)]
                    # prompt-only prompts sharing a context (its pass shared: PromptBatches.run_shared)
                    context = tokenizer("Question: which of these animals lives in the sea, swims fast and "
                                        "breathes air like we do? Answer:").input_ids
                    scored = [SequenceGroup(f"s{i}", context + tokenizer(a, add_special_tokens=False).input_ids,
                                            SamplingParams(max_tokens=0, prompt_logprobs=2), engine.table)
                              for i, a in enumerate([" the dolphin", " a cow", " the small brown horse"])]
                    shared = []
                    if hasattr(engine.runner, "prompt_batches"):
                        batches = engine.runner.prompt_batches
                        plain = batches.run_shared
                        batches.run_shared = lambda gs, cs, *rest: shared.append(cs) or plain(gs, cs, *rest)
                    run_groups(engine, groups + scored)
                finally:
                    engine.stop()
                worst = 0.0
                for g in scored:
                    ref = reference_rows(model64, list(g.prompt_ids))
                    want = ref[np.arange(len(g.prompt_ids) - 1), g.prompt_ids[1:]]
                    worst = max(worst, float(np.abs(g.prompt_columns.logprobs[1:] - want).max()))
                for g in groups:
                    for seq in g.sequences:
                        ids = list(g.prompt_ids) + seq.token_ids
                        ref = reference_rows(model64, ids)
                        got_prompt = g.prompt_columns.logprobs[1:]
                        want_prompt = ref[np.arange(len(g.prompt_ids) - 1), g.prompt_ids[1:]]
                        got_gen = np.asarray(seq.logprobs)
                        n = len(seq.token_ids)
                        want_gen = ref[np.arange(len(g.prompt_ids) - 1, len(g.prompt_ids) - 1 + n), seq.token_ids]
                        worst = max(worst, float(np.abs(got_prompt - want_prompt).max()),
                                    float(np.abs(got_gen - want_gen).max()))
                out[name] = {"runner": engine.info.runner, "max_abs_error": worst, "shared_prefix_ran": bool(shared)}
                say(f"   {name:22s} {engine.info.runner:12s} max |logprob - float64| = {worst:.2e}"
                    + ("  (shared-prefix scoring ran)" if shared else ""))
            except Exception as exc:
                traceback.print_exc()
                out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    tol = {"float32": 1e-4, "bfloat16": 0.5}
    out["passed"] = all("error" not in v and v["max_abs_error"] <= tol[k.split("/")[1]]
                        for k, v in out.items())
    return out


@section("the sampler's random numbers on the device and on the CPU")
def sampler_numbers(device, tokenizer):
    """The integers behind every draw (SplitMix64's outputs in int64 tensor operations) must be the same
    bits on the device as on the CPU, and the exponential numbers made from them the same up to float32
    rounding; then seeded generations of a float32 tiny model on the device and on the CPU are compared
    token by token (they may part only where two tokens' ratios tie within the devices' rounding)."""
    from test_families import build

    from logprobe.engine.device.sampler import _signed, noise, splitmix64
    from logprobe.engine.host.random_streams import Stream

    seeds = torch.tensor([_signed(s) for s in [0, 1, 2**63 - 1, 2**63, 2**64 - 1]]
                         + [_signed(Stream(7, i).seed(i)) for i in range(11)])
    vocab = 128_256
    bits_equal = torch.equal(splitmix64(seeds.to(device), vocab).cpu(), splitmix64(seeds, vocab))
    here, there = noise(seeds, vocab).double(), noise(seeds.to(device), vocab).cpu().double()
    finite = torch.isfinite(here)  # v rounding to 1 gives E = inf (that token cannot win): on both
    relative = float(((here - there).abs() / here)[finite].max()) if torch.equal(finite, torch.isfinite(there)) \
        else float("inf")
    model = build("llama", len(tokenizer))
    prompts = ["The quick brown fox jumps over the lazy dog", "One two three four five", "Paris is the capital of"]
    tokens = {}
    for where in ("cpu", device.type):
        m = __import__("copy").deepcopy(model).to(device=where, dtype=torch.float32)
        engine = Engine(m, tokenizer, f"tiny-{where}", [])
        engine.start()
        try:
            groups = [SequenceGroup(f"g{i}", tokenizer(p).input_ids,
                                    SamplingParams(max_tokens=24, n=3, temperature=1.0, seed=40 + i), engine.table)
                      for i, p in enumerate(prompts)]
            run_groups(engine, groups)
        finally:
            engine.stop()
        tokens[where] = [seq.token_ids for g in groups for seq in g.sequences]
    same = sum(a == b for a, b in zip(tokens["cpu"], tokens[device.type]))
    first_parting = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                     for a, b in zip(tokens["cpu"], tokens[device.type])]
    out = {"splitmix64_bits_equal": bits_equal, "noise_max_relative_difference": relative,
           "seeded_sequences_equal": f"{same} of {len(tokens['cpu'])}", "first_parting": first_parting}
    say(f"   SplitMix64 bits equal: {bits_equal}; exponential numbers within {relative:.1e} of each other;"
        f" seeded float32 generations equal on both: {same} of {len(tokens['cpu'])}")
    return out


# ---- 2b. the newer decode paths ---------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}}, "required": ["answer"],
          "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
BIAS, BANNED = ((330, 5.0), (17, -3.0)), (389, 12345)


# Each path runs on one engine and returns (arrays that must be equal on both engines, arrays of log
# probabilities compared within a tolerance, its largest error against float64, notes for the table).
def raw_error(model64, prompt_ids, tokens, logprobs) -> float:
    """Largest |generated token's log probability - float64's| of one choice."""
    if not len(tokens):
        return 0.0
    ref = reference_rows(model64, list(prompt_ids) + [int(t) for t in tokens])
    start = len(prompt_ids) - 1
    return float(np.abs(np.asarray(logprobs, np.float64) - ref[start + np.arange(len(tokens)), tokens]).max())


def constrained_path(engine, model64):
    """Greedy under a JSON schema (llguidance; masks on the grammar thread beside the forward pass)."""
    from logprobe.backend import Constraint

    g = SequenceGroup("constrained", engine.tokenizer("JSON:").input_ids,
                      SamplingParams(max_tokens=12, temperature=0, logprobs=3, logprobs_mode="both",
                                     stop_token_ids=engine.info.stop_token_ids,
                                     constraint=Constraint("json_schema", json.dumps(SCHEMA))), engine.table)
    c, = run_groups(engine, [g])[0].output().choices
    return [c.token_ids, c.top_ids], [c.logprobs, c.top_logprobs, c.processed_logprobs, c.constraint_logprobs], \
        raw_error(model64, g.prompt_ids, c.token_ids, c.logprobs), {"text": c.text}


def steered_path(engine, model64):
    """Seeded draws under logit_bias and bad words, both modes: raw, processed and constraint numbers
    against float64 (test_steering_reference's processed distribution, written from the API's words)."""
    from test_steering_reference import logsumexp, processed_reference

    g = SequenceGroup("steered", engine.tokenizer("The quick brown fox jumps over").input_ids,
                      SamplingParams(max_tokens=8, n=2, seed=7, temperature=0.8, logprobs=3, logprobs_mode="both",
                                     logit_bias=BIAS, bad_words_ids=tuple((t,) for t in BANNED),
                                     stop_token_ids=engine.info.stop_token_ids), engine.table)
    allowed = np.ones(engine.info.vocab_size, dtype=bool)
    allowed[list(BANNED)] = False
    exact, numbers, worst = [], [], 0.0
    for c in run_groups(engine, [g])[0].output().choices:
        exact += [c.token_ids, c.top_ids, c.processed_top_ids]
        numbers += [c.logprobs, c.top_logprobs, c.processed_logprobs, c.processed_top_logprobs, c.constraint_logprobs]
        rows = reference_rows(model64, g.prompt_ids + c.token_ids.tolist())[len(g.prompt_ids) - 1:]
        for i, token in enumerate(c.token_ids):
            dist = processed_reference(rows[i], BIAS, allowed, temperature=0.8)
            top = np.isfinite(c.processed_top_logprobs[i])
            worst = max(worst, abs(c.logprobs[i] - rows[i][token]), abs(c.processed_logprobs[i] - dist[token]),
                        abs(c.constraint_logprobs[i] - logsumexp(rows[i][allowed])),
                        float(np.abs(c.processed_top_logprobs[i][top] - dist[c.processed_top_ids[i][top]]).max()))
    return exact, numbers, float(worst), {}


def tree_path(engine, model64):
    """A token tree (depth 3, 4 branches: 84 nodes); each node's raw log probability at its own prefix."""
    from logprobe.backend import TreeShape
    from logprobe.engine.host.tree import TreeGroup

    g = TreeGroup("tree", [5, 17, 300, 4242], SamplingParams(max_tokens=3, temperature=1.0,
                                                              stop_token_ids=engine.info.stop_token_ids),
                  engine.table, TreeShape(depth=3, branches=4))
    t = run_groups(engine, [g])[0].output().tree
    rows = {p: reference_rows(model64, g.prompt_ids + (g.path(p) if p >= 0 else []))[-1] for p in set(t.parents)}
    worst = max(abs(float(lp) - rows[int(p)][tok]) for p, tok, lp in zip(t.parents, t.token_ids, t.logprobs))
    return [t.parents, t.token_ids, t.ranks], [t.logprobs, t.processed_logprobs, t.cumulative_logprobs,
                                                t.entropies], float(worst), {"nodes": len(t.token_ids)}


def interleaved_path(engine, model64):
    """Batch scoring lines, the pass held at its first block while two interactive requests are queued
    (test_interleaved_steps.FirstBlock): they must run in the next step, before the pass's next block;
    every number as uninterrupted and alone."""
    import test_interleaved_steps as steps

    lines, asked = steps.batch_lines(engine), steps.interactive_requests(engine)
    seen = []
    steps.FirstBlock(engine, lambda positions: seen.append((engine.num_steps, asked[0].is_finished,
                                                           sum(g.is_finished for g in lines)))).run(lines, asked)
    notes = {"at_first_block": len(seen) > 1 and seen[1] == (seen[0][0] + 2, True, 0)}
    alone = steps.copies(asked, engine.table)
    run_groups(engine, alone)
    notes["asked_as_alone"] = all(steps.numbers(a) == steps.numbers(b) for a, b in zip(alone, asked))
    try:
        steps.assert_as_uninterrupted(engine, lines)
        notes["lines_as_uninterrupted"] = True
    except AssertionError:
        notes["lines_as_uninterrupted"] = False
    worst = max(float(np.abs(g.prompt_columns.logprobs[1:] - reference_rows(model64, g.prompt_ids)[
        np.arange(len(g.prompt_ids) - 1), g.prompt_ids[1:]]).max()) for g in [*lines, asked[0]])
    seq = asked[1].sequences[0]
    worst = max(worst, raw_error(model64, asked[1].prompt_ids, seq.token_ids, seq.logprobs))
    exact = [np.asarray(seq.token_ids)] + [g.prompt_columns.top_ids for g in lines]
    return exact, [g.prompt_columns.logprobs for g in [*lines, asked[0]]] + [seq.logprobs], worst, notes


def client_loop_path(engine, model64, calls=24):
    """A client picking every token (a request a token, max_tokens 1, its prompt the ids so far) on the
    prefix cache: from the second call on one token through the blocks a call (prefix_cache.py); each
    token's log probability against float64."""
    from logprobe.engine.host.request import SamplingParams as Params, SequenceGroup as Group

    cache = engine.runner.prefix_cache
    hits, ids, tokens, logprobs, worst = cache.hits, [1] + [7 + (i * 37) % 900 for i in range(40)], [], [], 0.0
    for _ in range(calls):
        g = run_groups(engine, [Group("loop", list(ids), Params(max_tokens=1, logprobs=3, temperature=0),
                                      engine.table)])[0]
        token, lp = g.sequences[0].token_ids[0], g.sequences[0].logprobs[0]
        worst = max(worst, abs(lp - reference_rows(model64, ids)[-1][token]))
        tokens.append(token)
        logprobs.append(lp)
        ids = ids + [token]
    return [np.asarray(tokens)], [np.asarray(logprobs)], float(worst), {"all_hits": cache.hits - hits == calls - 1}


def prompt_step_path(engine, model64):
    """Interactive scoring requests in a pass held at its first block while a generation is queued
    (test_interleaved_steps, `_pause_point`): its prompt runs in the next step, before the pass's next block;
    every number as uninterrupted and alone."""
    import test_interleaved_steps as steps

    scores = [steps.make(engine, f"Scoring text {i} " + "with a few more words " * (3 + i), max_tokens=0,
                         prompt_logprobs=2) for i in range(3)]
    stream = steps.make(engine, "An interactive question about rivers", max_tokens=5, temperature=0, logprobs=3)
    seen = []
    steps.FirstBlock(engine, lambda positions: seen.append((engine.num_steps, len(stream.sequences[0].token_ids),
                                                           sum(g.is_finished for g in scores))),
                     batch=False).run(scores, [stream])
    notes = {"at_first_block": len(seen) > 1 and seen[1] == (seen[0][0] + 1, 1, 0)}
    alone = steps.copies([stream], engine.table)
    run_groups(engine, alone)
    notes["stream_as_alone"] = steps.numbers(alone[0]) == steps.numbers(stream)
    seq = stream.sequences[0]
    worst = raw_error(model64, stream.prompt_ids, seq.token_ids, seq.logprobs)
    worst = max([worst] + [float(np.abs(g.prompt_columns.logprobs[1:] - reference_rows(model64, g.prompt_ids)[
        np.arange(len(g.prompt_ids) - 1), g.prompt_ids[1:]]).max()) for g in scores])
    return [np.asarray(seq.token_ids)], [g.prompt_columns.logprobs for g in scores] + [seq.logprobs], worst, notes


def max_difference(a, b) -> float:
    """Largest |a - b| over the finite entries; infinite where their -inf entries differ."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape or not np.array_equal(np.isneginf(a), np.isneginf(b)):
        return float("inf")
    finite = np.isfinite(a)
    return float(np.abs(a[finite] - b[finite]).max()) if finite.any() else 0.0


@section("new decode paths on the device")
def decode_paths(device, tokenizer, tol=1e-4):
    """Each path on the device and on the CPU engine, the same float32 weights: the same tokens (ids,
    top ids, tree shape) exactly, every number within `tol` of the CPU's and of a float64 forward's."""
    import importlib.util

    from test_families import build

    model = build("llama", len(tokenizer))
    model64 = __import__("copy").deepcopy(model).double()
    paths = {"constrained": constrained_path, "steered": steered_path, "tree": tree_path,
             "interleaved": interleaved_path, "client_loop": client_loop_path, "prompt_step": prompt_step_path}
    if importlib.util.find_spec("llguidance") is None:
        paths.pop("constrained")
    runs = {}
    for side, where in enumerate(("cpu", device.type)):  # the same calls on both; only the weights' device differs
        engine = Engine(__import__("copy").deepcopy(model).to(device=where, dtype=torch.float32), tokenizer,
                        f"tiny-{where}", [])
        engine.start()
        try:
            for name, path in paths.items():
                try:
                    runs[side, name] = path(engine, model64)
                except Exception as exc:  # one broken path does not hide the others
                    traceback.print_exc()
                    runs[side, name] = f"{type(exc).__name__}: {exc}"
        finally:
            engine.stop()
        runner = engine.info.runner
    out = {"runner": runner}
    if "constrained" not in paths:
        out["constrained"] = {"skipped": "llguidance not installed"}
        say("   constrained  skipped: llguidance not installed")
    for name in paths:
        here, there = runs[0, name], runs[1, name]
        if isinstance(here, str) or isinstance(there, str):
            out[name] = {"passed": False, "error": there if isinstance(there, str) else f"on the CPU: {here}"}
        else:
            same = len(here[0]) == len(there[0]) and all(np.array_equal(x, y) for x, y in zip(here[0], there[0]))
            vs_cpu = max((max_difference(x, y) for x, y in zip(here[1], there[1])), default=0.0)
            out[name] = {"same_tokens": same, "max_abs_error_vs_cpu": vs_cpu, "max_abs_error_vs_float64": there[2],
                         **there[3]}
            out[name]["passed"] = same and vs_cpu <= tol and there[2] <= tol and all(
                v for v in there[3].values() if isinstance(v, bool))
        say(f"   {name:12s} " + ", ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}"
                                        for k, v in out[name].items()))
    out["passed"] = all(v["passed"] for v in out.values() if isinstance(v, dict) and "skipped" not in v)
    return out


def invariance_runs(engine, counts, others_of, seed):
    """The probes of tests/model/test_batch_invariance.py (a scored text, a generation asking for its
    prompt's numbers, a greedy and a seeded sampled generation) alone, then beside `count` others
    (`others_of(engine, count, rng)`), arriving in the same step or once the others run: per count,
    whether every number of every probe has the alone run's bits, the largest difference where not, the
    probes' fields that differ, and the run's seconds."""
    from test_batch_invariance import answer, drive, probes, prompt_probes, whole_answer

    def probes_of():
        return prompt_probes(engine) + probes(engine)

    def numbers(group):
        return whole_answer(group) if group.params.max_tokens == 0 or group.params.prompt_logprobs else \
            [np.asarray(a) for a in answer(group)]

    def timed(groups, later=(), after=0):
        sync(engine.runner.device)
        t0 = time.perf_counter()
        drive(engine, groups, later=later, after=after)
        sync(engine.runner.device)
        return time.perf_counter() - t0

    alone, seconds = probes_of(), 0.0
    for group in alone:
        seconds += timed([group])
    want = {g.request_id: numbers(g) for g in alone}
    out = {"alone_s": seconds}
    rng = np.random.default_rng(seed)
    for count in counts:
        mine, beside = probes_of(), others_of(engine, count, rng)
        together = bool(rng.integers(2))
        seconds = timed(beside + mine) if together else timed(beside, later=mine, after=int(rng.integers(1, 4)))
        differ, worst = [], 0.0
        for group in mine:
            got, expected = numbers(group), want[group.request_id]
            same = len(got) == len(expected) and all(
                a.shape == b.shape and np.array_equal(a, b, equal_nan=True) for a, b in zip(got, expected))
            if not same:
                differ.append(group.request_id)
                worst = max([worst] + [max_difference(a, b) for a, b in zip(got, expected)])
        out[f"beside_{count}"] = {"same_bits": not differ, "differ": differ, "max_abs_difference": worst,
                                  "arrived": "together" if together else "mid-run", "seconds": seconds}
    out["passed"] = all(v["same_bits"] for k, v in out.items() if k.startswith("beside_"))
    return out


@section("same bits beside other requests")
@torch.inference_mode()
def invariance(device, tokenizer, counts=(1, 15, 63)):
    """On tiny float32 Llama and Gemma 3 models on the device, with the prefix cache and without: a
    request's whole answer alone and beside 1, 15 and 63 requests of every kind (tests/model/
    test_batch_invariance.py's mix: scored texts, some sharing the probe's first tokens, generations with
    and without their prompt's numbers, greedy and sampled, 3-300 tokens), compared bit for bit."""
    from test_batch_invariance import mixed
    from test_families import build

    out = {}
    for kind in ("llama", "gemma3"):
        model = build(kind, len(tokenizer)).to(device=device, dtype=torch.float32)
        for cache_mb in (0, 64):
            engine = Engine(model, tokenizer, f"{kind}-{cache_mb}", [], prefix_cache_mb=cache_mb)
            name = f"{kind}, {'prefix cache' if cache_mb else 'no prefix cache'}"
            out[name] = invariance_runs(engine, counts, mixed, seed=17)
            say(f"   {name}: " + ", ".join(f"beside {c}: {'same bits' if out[name][f'beside_{c}']['same_bits'] else 'DIFFER ' + format(out[name][f'beside_{c}']['max_abs_difference'], '.1e')}"
                                          for c in counts))
    out["passed"] = all(v["passed"] for v in out.values() if isinstance(v, dict))
    return out


# ---- 3. the 8B-shaped model ------------------------------------------------------------------
def llama8b_config(small: bool):
    from transformers import LlamaConfig

    shape = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128_256)
    if small:
        shape = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=2, vocab_size=128_256)
    return LlamaConfig(**shape, max_position_embeddings=131_072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8192},
                       bos_token_id=None, eos_token_id=None, pad_token_id=None, initializer_range=0.02)


@section("load the 8B-shaped model")
def load_large(device, small, tokenizer, holder):
    from transformers import AutoModelForCausalLM

    cfg = llama8b_config(small)
    t0 = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval().requires_grad_(False)
    sync(device)
    params = sum(p.numel() for p in model.parameters())
    engine = Engine(model, tokenizer, "llama-8b-shaped", [], max_model_len=8192)
    holder["engine"], holder["params"] = engine, params
    holder["matmul_params"] = params - model.get_input_embeddings().weight.numel()
    out = {"params": params, "seconds": time.perf_counter() - t0, "runner": engine.info.runner}
    if device.type == "cuda":
        out["gpu_memory_GB"] = torch.cuda.memory_allocated(device) / 1e9
    say(f"   {params / 1e9:.2f}B parameters, {engine.info.runner} runner, {out['seconds']:.1f} s")
    return out


def step_until_decoding(engine, groups):
    for g in groups:
        engine.scheduler.add(g)
    while True:
        plan = engine.scheduler.schedule()
        if plan is None:
            return None
        if plan.decode and len(plan.decode) == len(groups) and not (plan.prefill or plan.score):
            return plan
        engine.step(plan)


def finish(engine, groups):
    for g in groups:
        engine.runner.release(g, engine.kv.release(g))
        engine.scheduler.finished(g)


def random_prompt(n, seed, vocab):
    return np.random.default_rng(seed).integers(100, vocab, n).tolist()


@section("same bits beside other requests, the 8B-shaped model")
@torch.inference_mode()
def invariance_large(holder, counts=(15, 63)):
    """The same probes on the 8B-shaped bfloat16 model, alone and beside 15 and 63 requests of every kind
    (`invariance`'s mix), with the seconds of each run: what the same bits hold at that shape and dtype."""
    from test_batch_invariance import mixed

    out = invariance_runs(holder["engine"], counts, mixed, seed=29)
    say("   " + ", ".join(f"beside {c}: {'same bits' if out[f'beside_{c}']['same_bits'] else 'DIFFER ' + format(out[f'beside_{c}']['max_abs_difference'], '.1e')}"
                          f" ({out[f'beside_{c}']['seconds']:.1f} s)" for c in counts))
    return out


@section("prefill")
@torch.inference_mode()
def prefill(device, holder, prompts=4, length=2048):
    engine = holder["engine"]
    vocab = engine.info.vocab_size
    for rep in range(2):  # the first round warms the kernels up
        groups = [SequenceGroup(f"p{i}", random_prompt(length, 10 * rep + i, vocab),
                                SamplingParams(max_tokens=1, temperature=0.0), engine.table) for i in range(prompts)]
        for g in groups:
            engine.scheduler.add(g)
        sync(device)
        t0 = time.perf_counter()
        while engine.scheduler.has_work:
            plan = engine.scheduler.schedule()
            if plan is None:
                break
            engine.step(plan)
        sync(device)
        seconds = time.perf_counter() - t0
        finish(engine, groups)
    tokens = prompts * length
    cfg = engine.model.config
    flops = 2 * holder["matmul_params"] * tokens + 4 * cfg.num_hidden_layers * cfg.hidden_size * length * length / 2 * prompts
    out = {"tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds, "TFLOPs": flops / seconds / 1e12}
    say(f"   {tokens} prompt tokens in {seconds:.3f} s: {out['tok_per_s']:,.0f} tok/s, {out['TFLOPs']:.0f} TFLOP/s")
    return out


@section("decode")
@torch.inference_mode()
def decode(device, holder, batches=(1, 16, 64)):
    engine = holder["engine"]
    out = {"weight_GB": weight_bytes(engine) / 1e9}
    # CUDA graphs of fixed-shape steps, and eager; a CPU (a dry run) runs the fixed-shape step eagerly
    modes = (True, False) if device.type == "cuda" else (True,)
    # (batch, graphs, pick in the step, top_p): the tokens picked in the recorded step, or after it (the
    # engine's pick, as for a batch with top-p rows, which also sorts: the last arm)
    arms = [(b, g, True, 1.0) for b in batches for g in modes] + [(b, modes[0], False, 1.0) for b in batches] \
        + [(max(batches), modes[0], True, 0.95)]
    for batch, graphs, in_step, top_p in arms:
        name, row = decode_arm(device, engine, batch, graphs, in_step, top_p)
        out[name] = row
    return out


@section("decode, the fixed-shape step compiled (torch.compile)")
@torch.inference_mode()
def decode_compiled(device, holder, batches=(1, 16, 64), budget_s=300.0):
    """The decode arms with graphs and the pick in the step, the step's pass compiled by torch.compile
    (`FixedShapeSteps.compile_step`): Inductor fuses each block's small kernels. Its first steps compile (the
    time is reported); beside each arm, its ratio to the same arm uncompiled (the decode section)."""
    engine = holder["engine"]
    runner = engine.runner
    # compile_step refuses a torch below the lowest its tests pass on (2.11 crashed compiling a second
    # model's pass in one process); this check compiles one model's, last of all (the JSON so far is
    # written), so on such a torch it measures anyway, past the refusal, and says so in its results.
    below = torch.__version__ < fixed_shape.COMPILE_MIN_TORCH
    out = {}
    if below:
        floor = ".".join(map(str, fixed_shape.COMPILE_MIN_TORCH))
        out["below_tested_torch"] = f"torch {torch.__version__} < {floor}, measured past compile_step's refusal"
        say(f"   {out['below_tested_torch']}")
    t0 = time.perf_counter()
    try:
        for batch in batches:
            if time.perf_counter() - t0 > budget_s:
                out[f"batch {batch}"] = {"skipped": f"compiling took over {budget_s:.0f} s"}
                continue
            # a CPU (a dry run): traced without generating kernels (Inductor cannot lower the CPU's
            # pre-packed bfloat16 products)
            backend = "inductor" if device.type == "cuda" else "aot_eager"
            if below:
                runner.fixed_shape._compile_step = backend
            else:
                runner.fixed_shape.compile_step = backend
            name, row = decode_arm(device, engine, batch, True, True, 1.0)
            plain = RESULTS.get("decode", {}).get(name, {})
            if "tok_per_s" in plain:
                row["vs_uncompiled"] = row["tok_per_s"] / plain["tok_per_s"]
                say(f"      {row['vs_uncompiled']:.3f}x the uncompiled step")
            out[name] = row
    finally:
        runner.fixed_shape.compile_step = None
        runner.fixed_shape.graphs.clear()
    return out


def weight_bytes(engine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.model.parameters())


def decode_arm(device, engine, batch, graphs, in_step, top_p, steps=48, prompt_len=128):
    """One decode arm: `batch` streams (temperature 1, seeded, logprobs 5, prompts of `prompt_len`),
    3 warm-up steps then `steps` timed ones. (name, row)."""
    runner = engine.runner
    vocab = engine.info.vocab_size
    picked = []
    real_pick = runner.decode_and_pick

    def counted_pick(groups, k):
        lsms, host = real_pick(groups, k)
        picked.append(host is not None)
        return lsms, host

    runner.decode_and_pick = counted_pick
    runner.static_decode, runner.pick_in_step = graphs, in_step
    runner.fixed_shape.graphs.clear()
    try:
        groups = [SequenceGroup(f"d{i}", random_prompt(prompt_len, 1000 + i, vocab),
                                SamplingParams(max_tokens=4096, temperature=1.0, top_p=top_p, seed=i, logprobs=5),
                                engine.table)
                  for i in range(batch)]
        plan = step_until_decoding(engine, groups)
        first = time.perf_counter()
        engine.step(plan)  # the first step records the graph (and compiles the pass where it is compiled)
        sync(device)
        first = time.perf_counter() - first
        for _ in range(2):  # warm-up steps
            engine.step(plan)
        sync(device)
        walls, busy = [], []
        picked.clear()
        for _ in range(steps):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            engine.step(plan)
            walls.append(time.perf_counter() - t0)
            if device.type == "cuda":
                end.record()
                sync(device)
                busy.append(start.elapsed_time(end) / 1e3)
        syncs = [count_syncs(engine, plan, device) for _ in range(3)]  # apart: the debug mode costs time
        kernels = kernel_time(engine, plan, device)
        finish(engine, groups)
    finally:
        runner.decode_and_pick = real_pick
        runner.static_decode, runner.pick_in_step = device.type == "cuda", True
    step = float(np.median(walls))
    row = {"batch": batch, "graphs": graphs, "pick_in_step": in_step, "top_p": top_p,
           "compiled": runner.fixed_shape.compile_step, "first_step_s": first, "step_ms": step * 1e3,
           "tok_per_s": batch / step, "syncs_per_step": int(np.median(syncs)),
           "picked_in_step": f"{sum(picked[:steps])} of {len(picked[:steps])}"}
    if busy:
        row["device_ms"] = float(np.median(busy)) * 1e3
    if kernels is not None:
        row["kernel_ms"], row["top_kernels"], row["kernels_per_step"], row["small_kernel_ms"] = kernels
    kv_bytes = runner.kv_cache_bytes
    read = weight_bytes(engine) + kv_bytes  # an upper bound of the cache's share: all of it allocated
    row["GBps_weights_only"] = weight_bytes(engine) / step / 1e9
    name = f"batch {batch}" + ("" if graphs else " eager") + ("" if in_step else " pick after") \
        + ("" if top_p == 1.0 else f" top_p {top_p}")
    say(f"   {name:24s}: {row['tok_per_s']:8.1f} tok/s, step {row['step_ms']:.2f} ms (first {first:.1f} s),"
        f" picked in the step {row['picked_in_step']}"
        + (f" (device clock {row['device_ms']:.2f} ms)" if busy else "")
        + (f", kernels busy {row['kernel_ms']:.2f} ms ({row['kernels_per_step']:.0f} a step,"
           f" those under 10 us {row['small_kernel_ms']:.2f} ms)" if kernels else "")
        + f", {row['GBps_weights_only']:.0f} GB/s of weights, {row['syncs_per_step']} syncs/step,"
        f" KV allocated {kv_bytes / 1e9:.2f} GB (read bound {read / 1e9:.1f} GB)")
    for kernel, ms, count in row.get("top_kernels", []):
        say(f"      {ms:7.3f} ms  x{count:<4d} {kernel}")
    return name, row


def count_syncs(engine, plan, device) -> int:
    """Device-to-host synchronizations in one decode step (CUDA's sync debug mode warns at each)."""
    if device.type != "cuda":
        return 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.step(plan)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def kernel_time(engine, plan, device, steps=3):
    """(milliseconds the device's kernels run per decode step, the eight longest kernels, kernel launches
    per step, milliseconds in kernels of under 10 us on average) from the profiler: beside the step's
    wall time, how much of it the device is busy, and how much of that the small kernels of the blocks
    (norms, RoPE, cache writes, residual adds, the activation) take, which fusing them would shrink."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step(plan)
        sync(device)
    from torch.autograd import DeviceType

    # the device's own events only: an operator launched from the host (the pick after the replay) also
    # carries its kernels' time, which would count them twice
    events = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    if not events:
        say("      (the profiler recorded no device kernels)")
        return None
    total = sum(e.self_device_time_total for e in events) / 1e3 / steps
    launches = sum(e.count for e in events) / steps
    small = sum(e.self_device_time_total for e in events if e.self_device_time_total / e.count < 10) / 1e3 / steps
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:8]
    return total, [(e.key[:80], round(e.self_device_time_total / 1e3 / steps, 3), e.count // steps) for e in top], \
        launches, small


@section("whole vocabulary, 256 positions, end to end")
def whole_vocab(device, holder, tokenizer):
    from fastapi.testclient import TestClient

    from logprobe.api.app import create_app
    from logprobe.client import dense_prompt_logprobs

    engine = holder["engine"]
    engine.start()
    try:
        app = create_app(engine)
        ids = random_prompt(256, 7, engine.info.vocab_size)
        body = {"model": "llama-8b-shaped", "prompt": ids, "max_tokens": 0, "echo": True, "prompt_logprobs": -1,
                "vocab_encoding": "float32"}
        with TestClient(app) as client:
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                r = client.post("/v1/completions", json=body)
                content = r.content
                times.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    raise RuntimeError(f"{r.status_code}: {content[:400]!r}")
            table = dense_prompt_logprobs(json.loads(content)["choices"][0]["prompt_logprobs"])
    finally:
        engine.stop()
    rows = np.asarray(table[1:], dtype=np.float64)
    mass = np.exp(rows).sum(axis=1)
    out = {"seconds": times, "best_s": min(times), "bytes": len(content), "positions": int(rows.shape[0]),
           "vocab": int(rows.shape[1]), "max_mass_error": float(np.abs(mass - 1).max())}
    say(f"   {rows.shape[0]} x {rows.shape[1]} in {min(times):.2f} s (runs {', '.join(f'{t:.2f}' for t in times)}),"
        f" {len(content) / 1e6:.0f} MB, probabilities sum to 1 within {out['max_mass_error']:.1e}")
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip: families,sampler,paths,invariance,whole,compile")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    OUT[:] = [args.out]
    device = torch.device(args.device)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    RESULTS["conditions"] = {"device": str(device), "torch": torch.__version__, "python": platform.python_version(),
                             "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    import transformers

    RESULTS["conditions"]["transformers"] = transformers.__version__
    ceilings(device)
    skip = set(args.skip.split(","))
    if "families" not in skip:
        families(device, tokenizer)
    if "sampler" not in skip:
        sampler_numbers(device, tokenizer)
    if "paths" not in skip:
        decode_paths(device, tokenizer)
    if "invariance" not in skip:
        invariance(device, tokenizer)
    holder = {}
    load_large(device, args.small, tokenizer, holder)
    if "engine" in holder:
        prefill(device, holder)
        decode(device, holder)
        if "invariance" not in skip:
            invariance_large(holder)
        if "whole" not in skip:
            whole_vocab(device, holder, tokenizer)
        if "compile" not in skip:
            decode_compiled(device, holder)
    write()
    say(f"\nwritten to {args.out}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
