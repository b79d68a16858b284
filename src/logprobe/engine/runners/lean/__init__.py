"""The lean runner: logprobe runs a decoder's blocks itself, with the model's own weights and modules,
over a KV cache in size classes (kv_cache.py). What differs between model families (weight layout,
norms, RoPE tables, sliding windows, attention scale, activation) is described by a family file in
families/ (Llama/Mistral/Qwen2, Gemma 3, Qwen 3, Phi-3); a model no family claims, or a configuration
its family refuses, runs on transformers' forward (runner.py) instead. The model card reports which
(`"runner": "lean"` or `"transformers"`).

One decode step: `LeanRunner._decode` -> `prepare_decode` (a `PassMeta`: positions, each slab's rows and
masks) -> `forward` (the blocks, `Attention` reading the meta) -> the head's log probabilities -> the
engine's pick (or `sampler.pick` inside the fixed-shape step).

* runner.py: `LeanRunner`, the forward pass, decode steps over every running row, bookkeeping.
* attention.py: `PassMeta` and the key/value layouts, the masks, the one `Attention` of every pass.
* prefill.py: prompts prefilled in chunks, several prompts' chunks in one pass.
* prompt_batch.py: prompt-only groups in one right-padded pass; prompts sharing a prefix run it once,
  and prefixes kept by the prefix cache (prefix_cache.py) are not run again.
* fixed_shape.py: on a GPU, a batch held in one size class runs a decode step of fixed shapes, recorded
  once as a CUDA graph per batch size, class and span and replayed.
* weights.py: each block's weights (`BlockWeights`); in bfloat16 every projection and the head pre-packed
  for oneDNN once (same numbers as the plain product); `--quantization int4`: every decode row reads
  the model's own 4-bit weights (int4.py), every prompt row the dense ones.

Numbers are the same computation as transformers' (same modules, same RoPE, same masks up to padding),
checked against a float64 forward of transformers' own implementation in the tests.
"""

from __future__ import annotations

import logging

from ..families import family_of
from .fixed_shape import COMPILE_MIN_TORCH
from .prompt_batch import shared_prefixes
from .runner import LeanRunner
from .weights import packing_works

__all__ = ["COMPILE_MIN_TORCH", "LeanRunner", "packing_works", "shared_prefixes", "supports"]

log = logging.getLogger("logprobe.engine")


def supports(model) -> bool:
    """Whether a family of the lean runner runs this model; if not, why is logged (it then runs on
    transformers' forward)."""
    family, reason = family_of(model)
    if family is None:
        log.info("lean runner unavailable, running on transformers' forward: %s", reason)
    return family is not None
