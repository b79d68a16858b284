"""The lean runner's weights: each block's projections as `Linear`s (pre-packed for oneDNN in bfloat16 on
a CPU, with their 4-bit form under `--quantization int4`) and its norms, in one `BlockWeights` record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..int4 import Int4Linear
from .row_floors import onednn_product, packed_floor, product_for


def packing_works(dtype, device) -> bool:
    """Whether weights can be pre-packed for oneDNN here: bfloat16/float16 on a CPU with oneDNN, and a
    probe product equals the plain one bit for bit (so packing changes speed, never a number)."""
    if dtype not in (torch.bfloat16, torch.float16) or device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(96, 64, generator=gen).to(dtype)
        x = torch.randn(3, 5, 64, generator=gen).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        return torch.equal(torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), F.linear(x, w))
    except Exception:  # an op missing from this build of torch: the plain product
        return False


class Linear:
    """A weight [N, K] (and bias) of the lean runner. In bfloat16 on CPUs the weight is pre-packed once
    into oneDNN's blocked layout: the plain bfloat16 product repacks it on every call, which costs
    more than the product itself for a few rows (one-row products 1.9x, an 84-row one 1.5x, the
    output head for one row 1.5x faster measured here). Same kernel, same numbers.

    In float32 on a CPU the product is the one that gives a row the same bits whatever the call's row
    count (row_floors.product_for, measured once per shape): `F.linear` (MKL) where it does at every
    count, else oneDNN's product of the plain weight, and a call of fewer rows than the product's floor
    is padded with rows of zeros (`min_rows`). A packed bfloat16 product's call of 1 row is padded to 2
    where this shape's one-row path gives other bits (row_floors.packed_floor): on an AMD EPYC a row of
    SmolLM2's `down_proj` came out 1 bfloat16 unit apart in a call of 1 row and in calls of 2 to 300
    (docs/performance.md); its other products take one path.

    With 4-bit weights (`--quantization int4`) a pass's decode rows, its first `int4_rows`, read those
    (PyTorch's int4 kernel gives a row the same bits in calls of any row count) and its prompt rows the
    dense ones: a row reads the same weights whatever shares its call."""

    __slots__ = ("weight", "bias", "packed", "int4", "onednn", "min_rows")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool, int4: Int4Linear | None = None):
        self.weight, self.bias = weight, bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight) if pack else None
        self.int4 = int4  # the same matrix as 4-bit integers, for decode rows
        self.onednn, self.min_rows = False, 1
        if not pack and weight.dtype == torch.float32 and weight.device.type == "cpu":
            self.onednn, self.min_rows = product_for(*weight.shape, torch.get_num_threads())
        elif pack:
            self.min_rows = packed_floor(*weight.shape, weight.dtype, torch.get_num_threads())

    @classmethod
    def of(cls, module, pack: bool, int4: Int4Linear | None = None) -> "Linear":
        return cls(module.weight, module.bias, pack, int4)

    def __call__(self, x: torch.Tensor, int4_rows: int = 0) -> torch.Tensor:
        """x [rows, K] (or [..., K]) -> [rows, N]; with 4-bit weights its first `int4_rows` rows read those."""
        if int4_rows and self.int4 is not None:
            rows = x.numel() // x.shape[-1]
            if int4_rows >= rows:
                return self._four_bit(x)
            # decode rows and prompt chunks in one pass: each kind reads its own weights
            flat = x.reshape(rows, x.shape[-1])
            y = torch.cat([self._four_bit(flat[:int4_rows]), self._dense(flat[int4_rows:])])
            return y.view(*x.shape[:-1], y.shape[-1])
        return self._dense(x)

    def _four_bit(self, x: torch.Tensor) -> torch.Tensor:
        y = self.int4(x)
        return y if self.bias is None else y + self.bias

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows < self.min_rows:  # padded to the floor of rows whose bits do not depend on the count
            flat = x.reshape(rows, x.shape[-1])
            y = self._product(torch.cat([flat, flat.new_zeros(self.min_rows - rows, flat.shape[1])]))
            return y[:rows].view(*x.shape[:-1], y.shape[-1])
        return self._product(x)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.onednn and not torch.compiler.is_compiling():  # inductor lowers oneDNN's op for frozen weights only
            return onednn_product(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


@dataclass(slots=True)
class BlockWeights:
    """One decoder block as the lean runner reads it (families/base.Block with its projections made
    `Linear`s)."""

    qkv: Linear  # fused [q; k; v]: [B * T, D] -> [B * T, (H + 2 KV) d]
    o_proj: Linear
    gate_up: Linear  # fused [gate; up]: [B * T, D] -> [B * T, 2 I]
    down_proj: Linear
    input_norm: Callable  # before the attention
    pre_ff_norm: Callable  # before the MLP
    act: Callable  # on the gate
    post_attn_norm: Callable | None  # on the attention's output, before the residual add
    post_ff_norm: Callable | None  # on the MLP's output, before the residual add
    qk_norm: Callable | None  # on queries and keys [B, T, H + KV, d], before RoPE
    rope: object  # key of this block's RoPE table in `Family.rope_tables`

    @property
    def linears(self) -> tuple[Linear, Linear, Linear, Linear]:
        return self.qkv, self.o_proj, self.gate_up, self.down_proj


def load_blocks(family, layers, int4_grids: dict | None, pack: bool, release: Callable | None
                ) -> tuple[list[BlockWeights], list[int | None], int]:
    """Every block's weights, its sliding window (None: full attention), and the bytes released:
    `release(linears, module)`, when given, frees transformers' copies of a block's packed weights as
    soon as they are packed, block by block (the peak is the weights and one block's packed copy)."""
    with torch.no_grad():
        blocks = family.blocks()  # fuses q/k/v and gate/up where the model keeps them apart
    weights, windows, released = [], [], 0
    for index in range(len(blocks)):
        block, blocks[index] = blocks[index], None  # its fused weights are held by its Linears only
        q4 = [None] * 4
        if int4_grids is not None:
            try:
                q4 = [Int4Linear([int4_grids[f"layers.{index}.{name}"] for name in names])
                      for names in block.int4_names]
            except KeyError as exc:
                raise ValueError(f"no 4-bit grid for {exc.args[0]}") from None
        weights.append(BlockWeights(
            Linear(*block.qkv, pack, q4[0]), Linear.of(block.o_proj, pack, q4[1]), Linear(*block.gate_up, pack, q4[2]),
            Linear.of(block.down_proj, pack, q4[3]), block.input_norm, block.pre_ff_norm, block.act,
            block.post_attn_norm, block.post_ff_norm, block.qk_norm, block.rope))
        windows.append(block.window)
        del block
        if release is not None:
            released += release(weights[-1].linears, layers[index])
    return weights, windows, released


def release_packed(model, linears, root) -> int:
    """Keep each packed weight once: the packed copy is all the lean runner reads, so transformers'
    modules under `root` whose weights these Linears packed are emptied, and the Linears drop their
    plain weight too (bytes freed returned). In bfloat16 the weights would otherwise be held twice
    (an 8B model: 16 GB more). A head tied to the embedding is kept: the lean runner embeds with it.
    transformers' forward of this model cannot run afterwards; nothing on the lean runner calls it
    (activations are read by `LeanRunner.residual_stream`)."""
    storages = {lin.weight.untyped_storage().data_ptr(): lin.weight.untyped_storage().nbytes() for lin in linears}
    storages.pop(model.get_input_embeddings().weight.untyped_storage().data_ptr(), None)
    for module in root.modules():
        weight = getattr(module, "weight", None)
        if (isinstance(module, torch.nn.Linear) and isinstance(weight, torch.Tensor) and weight.numel()
                and weight.untyped_storage().data_ptr() in storages):
            module.weight = torch.nn.Parameter(weight.new_empty(0), requires_grad=False)
    for lin in linears:
        if lin.weight.untyped_storage().data_ptr() in storages:
            lin.weight = None
    return sum(storages.values())
