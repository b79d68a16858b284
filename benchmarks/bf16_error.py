"""How far bfloat16 and 4-bit decode weights move the log probabilities from float32, so users can
choose (`--dtype`, `--quantization`).

The bundled model scores a small English corpus (every token's log probability given the text before
it, and the whole vocabulary at every position) with float32 weights and with bfloat16 weights
(log_softmax in float32 in both, as the server does), through the engine's scoring path. Then the same
texts go through the decode path one token at a time (teacher-forced: each step's input is the text's
next token), with `--quantization int4` on float32 and on bfloat16, and their rows are compared with
the float32 scoring rows. Prints the max and mean absolute difference of the scored tokens' log
probabilities, of the whole vocabulary's, and how often the likeliest token changes.

    python benchmarks/bf16_error.py
"""

from __future__ import annotations

import asyncio

import numpy as np
import torch

CORPUS = [
    "The history of the city goes back to a small settlement on the river, where fishermen traded with "
    "merchants who came down from the hills every spring.",
    "Scientists measured the temperature of the lake every morning for a year and found that the water "
    "warmed faster than the air around it.",
    "She opened the old book and found a letter hidden between the pages, written in a hand she did not "
    "recognise, addressed to someone who had lived there long ago.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "In 1969, two astronauts walked on the Moon while a third orbited above them in the command module.",
    "The committee agreed that the new bridge would be finished by the spring, although the budget was "
    "still under discussion.",
]


def score_all(dtype: str):
    from logprobe.engine.runners import loader
    from logprobe.engine.engine import Engine
    from logprobe.engine.host.request import SamplingParams, SequenceGroup

    model, tok = loader.load(loader.resolve_source(None), dtype=dtype)
    engine = Engine(model, tok, "bench")
    engine.start()
    try:
        groups = [SequenceGroup("b", tok(text).input_ids, SamplingParams(max_tokens=0, prompt_logprobs=-1,
                                                                         echo=True, logprobs=1), engine.table)
                  for text in CORPUS]
        asyncio.run(engine.run_groups(groups))
        return [(g.prompt_columns.logprobs[1:].copy(), g.prompt_columns.full[1:].copy()) for g in groups]
    finally:
        engine.stop()


@torch.inference_mode()
def decode_all(dtype: str, quantization: str):
    """Each text through the decode path, one token per step: the rows of positions 1..L-2 as
    (scored token's log probability, whole vocabulary), like score_all's rows from position 1 on."""
    from logprobe.engine.runners import loader
    from logprobe.engine.engine import Engine
    from logprobe.engine.host.request import SamplingParams, SequenceGroup

    model, tok = loader.load(loader.resolve_source(None), dtype=dtype, quantization=quantization)
    engine = Engine(model, tok, "bench")
    runner = engine.runner
    out = []
    for text in CORPUS:
        ids = tok(text).input_ids
        group = SequenceGroup("b", ids[:1], SamplingParams(max_tokens=len(ids)), engine.table)
        group.active_rows = [0]
        runner.prefill_chunk(group, 1)
        runner.expand(group, *engine.kv.expand(group, 1))
        rows = []
        for position in range(1, len(ids) - 1):
            group.sequences[0].token_ids.append(ids[position])
            runner.move(engine.kv.make_room())  # as the engine's step: room, the pass, the position counted
            rows.append(runner.decode_groups([group])[0][0].numpy().copy())  # predicts ids[position + 1]
            engine.kv.advance()
        runner.release(group, engine.kv.release(group))
        full = np.stack(rows)
        out.append((full[np.arange(len(rows)), ids[2:]], full))
    return out


def report(title: str, ref, other) -> None:
    token_diff = np.concatenate([np.abs(a[0] - b[0]) for a, b in zip(ref, other)])
    vocab_diff = np.concatenate([np.abs(a[1] - b[1]).ravel() for a, b in zip(ref, other)])
    argmax_changed = np.concatenate([a[1].argmax(1) != b[1].argmax(1) for a, b in zip(ref, other)])
    print(f"{title}: {len(token_diff)} tokens")
    print(f"  scored tokens' log probabilities: max |diff| {token_diff.max():.4f}, mean {token_diff.mean():.4f}, "
          f"median {np.median(token_diff):.4f} nats")
    print(f"  whole vocabulary ({vocab_diff.size:,} values): max |diff| {vocab_diff.max():.4f}, "
          f"mean {vocab_diff.mean():.4f} nats")
    print(f"  likeliest token differs at {argmax_changed.sum()} of {argmax_changed.size} positions")


def main() -> None:
    torch.manual_seed(0)
    f32, bf16 = score_all("float32"), score_all("bfloat16")
    print(f"conditions: bundled SmolLM2-135M, {len(CORPUS)} texts, against float32 scoring "
          "(log_softmax in float32 everywhere)")
    report("bfloat16 weights and activations, scoring path", f32, bf16)
    from logprobe.engine.runners import int4

    # the decode rows leave out each text's first scored position (it comes from the prefill)
    f32_from_2 = [(a[1:], b[1:]) for a, b in f32]
    report("float32 decode path, teacher-forced (sanity: same numbers)", f32_from_2, decode_all("float32", "none"))
    if int4.available():
        report("--quantization int4 on float32, decode path", f32_from_2, decode_all("float32", "int4"))
        report("--quantization int4 on bfloat16, decode path", f32_from_2, decode_all("bfloat16", "int4"))
        report("bfloat16 without int4, decode path", f32_from_2, decode_all("bfloat16", "none"))


if __name__ == "__main__":
    main()
