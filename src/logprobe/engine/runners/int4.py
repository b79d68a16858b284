"""4-bit weights for decode steps (`--quantization int4`).

A Q4_0 or Q4_1 GGUF stores each run of 32 weights of a row as 4-bit integers q with a scale d and an
offset m: w = d * q + m. logprobe loads such a file dequantized (float32 by default), so the numbers of
the prompt passes are those of the file's own weights. One-row decode steps, though, are bound by the
bytes of weights read per token (540 MB in float32 for SmolLM2-135M, 270 MB in bfloat16); read as
4-bit, the same matrices are 68 MB.

This module finds the 4-bit grid back in the dequantized weights (exactly: every group's values must be
d * q + m for integers 0 <= q <= 15, or the matrix is refused) and packs it for PyTorch's CPU int4
kernel (`_weight_int4pack_mm_for_cpu`), which computes x @ ((q - 8) * s + z).T with bfloat16 inputs,
scales and offsets and float32 sums. The weights are therefore the file's own integers; what rounds is
the inputs, the scales and offsets (to bfloat16) and the outputs (to bfloat16): the same order of error
as `--dtype bfloat16`, measured in the README.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32  # weights per scale: the block of Q4_0 / Q4_1


@dataclass
class Grid:
    """One matrix [N, K] as 4-bit integers with a scale and an offset per group of GROUP columns."""

    q: torch.Tensor  # [N, K] uint8, 0..15
    scale: torch.Tensor  # [N, K / GROUP] float32
    offset: torch.Tensor  # [N, K / GROUP] float32: the value of q = 0


def grid_of(weight: torch.Tensor) -> Grid | None:
    """The 4-bit grid a float32 matrix lies on, or None when it lies on none (a value off its group's
    grid by more than a few float32 roundings)."""
    w = weight.detach().to(torch.float32)
    if w.dim() != 2 or w.shape[1] % GROUP:
        return None
    n, k = w.shape
    groups = w.reshape(n, k // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    best = None
    # The step is (high - low) / 15 when both ends are used (llama.cpp's quantizer puts the minimum at
    # q = 0 and the maximum at q = 15); GGUF stores it in float16, so try that rounding first.
    for step in (((high - low) / 15).half().float(), (high - low) / 15):
        safe = torch.where(step > 0, step, torch.ones_like(step))
        q = torch.round((groups - low[..., None]) / safe[..., None]).clamp_(0, 15)
        error = (q * step[..., None] + low[..., None] - groups).abs()
        # allowed: a few float32 roundings of the group's largest value (dequantization's own)
        allowed = 4 * torch.finfo(torch.float32).eps * groups.abs().amax(-1, keepdim=True)
        if bool((error <= allowed).all()):
            best = Grid(q.to(torch.uint8).reshape(n, k), step, low)
            break
    return best


class Int4Linear:
    """Packed 4-bit weights (one or several grids stacked along N) and their bfloat16 scales/offsets."""

    __slots__ = ("packed", "scales_and_zeros", "out_features")

    def __init__(self, grids: list[Grid]):
        q = torch.cat([g.q for g in grids]).to(torch.int32)
        scale = torch.cat([g.scale for g in grids])
        # the kernel dequantizes (q - 8) * s + z: z = offset + 8 * scale gives d * q + m
        zero = torch.cat([g.offset + 8 * g.scale for g in grids])
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.out_features = q.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.bfloat16:  # the lean runner's decode rows: no reshape, no cast
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_and_zeros)
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.packed,
                                                         GROUP, self.scales_and_zeros)
        return y.to(x.dtype).view(*shape[:-1], self.out_features)


def available() -> bool:
    """Whether this build of torch has the CPU int4 kernel."""
    try:
        q = torch.zeros(64, GROUP * 2, dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        sz = torch.zeros(2, 64, 2, dtype=torch.bfloat16)
        torch.ops.aten._weight_int4pack_mm_for_cpu(torch.zeros(1, GROUP * 2, dtype=torch.bfloat16), packed, GROUP, sz)
        return True
    except Exception:
        return False


def decoder_grids(model) -> dict[str, Grid]:
    """Grids of every projection of a Llama-family decoder's blocks, by module name; raises ValueError
    naming the first matrix that is not 4-bit."""
    grids = {}
    decoder = getattr(model, model.base_model_prefix)
    for index, layer in enumerate(decoder.layers):
        for part, module in (("self_attn.q_proj", layer.self_attn.q_proj), ("self_attn.k_proj", layer.self_attn.k_proj),
                             ("self_attn.v_proj", layer.self_attn.v_proj), ("self_attn.o_proj", layer.self_attn.o_proj),
                             ("mlp.gate_proj", layer.mlp.gate_proj), ("mlp.up_proj", layer.mlp.up_proj),
                             ("mlp.down_proj", layer.mlp.down_proj)):
            name = f"layers.{index}.{part}"
            if getattr(module, "bias", None) is not None:
                raise ValueError(f"{name} has a bias (only bias-free 4-bit projections are supported)")
            grid = grid_of(module.weight)
            if grid is None:
                raise ValueError(f"{name} is not on a 4-bit grid of {GROUP}-value groups")
            grids[name] = grid
    return grids
