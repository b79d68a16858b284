"""How far bfloat16 moves the log probabilities from float32, so users can choose (`--dtype`).

The bundled model scores a small English corpus (every token's log probability given the text before
it, and the whole vocabulary at every position) with float32 weights and with bfloat16 weights
(log_softmax in float32 in both, as the server does), through the engine's scoring path. Prints the
max and mean absolute difference of the scored tokens' log probabilities, of the whole vocabulary's,
and how often the likeliest token changes.

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
    from logprobe.engine import loader
    from logprobe.engine.engine import Engine
    from logprobe.engine.request import SamplingParams, SequenceGroup

    model, tok = loader.load(loader.resolve_source(None), dtype=dtype)
    engine = Engine(model, tok, "bench")
    engine.start()
    try:
        groups = [SequenceGroup("b", tok(text).input_ids, SamplingParams(max_tokens=0, prompt_logprobs=-1,
                                                                         echo=True, logprobs=1), engine.table)
                  for text in CORPUS]
        asyncio.run(engine.run(groups))
        return [(g.prompt_columns.logprobs[1:].copy(), g.prompt_columns.full[1:].copy()) for g in groups]
    finally:
        engine.stop()


def main() -> None:
    torch.manual_seed(0)
    f32, bf16 = score_all("float32"), score_all("bfloat16")
    token_diff = np.concatenate([np.abs(a[0] - b[0]) for a, b in zip(f32, bf16)])
    vocab_diff = np.concatenate([np.abs(a[1] - b[1]).ravel() for a, b in zip(f32, bf16)])
    argmax_changed = np.concatenate([a[1].argmax(1) != b[1].argmax(1) for a, b in zip(f32, bf16)])
    print(f"conditions: bundled SmolLM2-135M, {len(token_diff)} scored tokens from {len(CORPUS)} texts, "
          "bfloat16 weights and activations vs float32, log_softmax in float32")
    print(f"scored tokens' log probabilities: max |diff| {token_diff.max():.4f}, mean {token_diff.mean():.4f}, "
          f"median {np.median(token_diff):.4f} nats")
    print(f"whole vocabulary ({vocab_diff.size:,} values): max |diff| {vocab_diff.max():.4f}, "
          f"mean {vocab_diff.mean():.4f} nats")
    print(f"likeliest token differs at {argmax_changed.sum()} of {argmax_changed.size} positions")


if __name__ == "__main__":
    main()
