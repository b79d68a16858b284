"""What a model family tells the lean runner (engine/runners/lean/), and the parts families share.

The runner runs every family's blocks with one loop: queries, keys and values from one fused product,
optional norms on the queries and keys, RoPE, attention over its slot KV cache (masked to the layer's
sliding window where it has one), the output projection, then a gated MLP, with optional norms after
the attention and after the MLP. A family says how its model fills that loop, layer by layer (a
`Block`), and which configurations it cannot run (`refusal`: those run on transformers' forward).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

# RoPE types whose frequencies depend on the longest position of the batch (transformers'
# `dynamic_rope_update` switches longrope's factors past `original_max_position_embeddings`): in a
# batched decode step one request's numbers would depend on another's.
BATCH_DEPENDENT_ROPE = {"longrope"}


@dataclass
class Block:
    """One decoder layer as the lean runner runs it."""

    qkv: tuple[torch.Tensor, torch.Tensor | None]  # fused [q; k; v] weight [(H + 2 KV) d, D] and bias
    o_proj: torch.nn.Module
    gate_up: tuple[torch.Tensor, torch.Tensor | None]  # fused [gate; up] weight [2 I, D] and bias
    down_proj: torch.nn.Module
    input_norm: Callable  # before the attention
    pre_ff_norm: Callable  # before the MLP
    act: Callable  # on the gate
    post_attn_norm: Callable | None = None  # on the attention's output, before the residual add
    post_ff_norm: Callable | None = None  # on the MLP's output, before the residual add
    qk_norm: Callable | None = None  # on queries and keys [B, T, H + KV, d], before RoPE
    rope: object = None  # key of this layer's RoPE table in `Family.rope_tables`
    window: int | None = None  # sliding window: a query at p sees keys p - window < j <= p
    int4_names: tuple = ()  # module names (under layers.{i}.) of the 4-bit grids of qkv, o, gate_up, down


class Family:
    """A model family on the lean runner. Subclasses name the `model_types` they claim and override
    what differs from Llama's layout (the defaults here)."""

    name = "base"
    model_types: frozenset[str] = frozenset()
    attention_parts = ("q_proj", "k_proj", "v_proj", "o_proj")
    mlp_parts = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, model):
        self.model = model
        self.config = model.config
        self.decoder = getattr(model, getattr(model, "base_model_prefix", ""), None)
        cfg = self.config
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads

    @classmethod
    def claims(cls, model) -> bool:
        return getattr(model.config, "model_type", None) in cls.model_types

    # ---- what the lean runner cannot run -------------------------------------------------------
    def refusal(self) -> str | None:
        """Why this model cannot run on the lean runner (it then runs on transformers' forward), or None."""
        decoder = self.decoder
        if decoder is None or not hasattr(decoder, "layers") or not len(decoder.layers):
            return "no decoder layers where the family keeps them"
        for attr in ("embed_tokens", "norm", "rotary_emb"):
            if not hasattr(decoder, attr):
                return f"the decoder has no {attr}"
        for layer in decoder.layers:
            missing = [p for p in self.attention_parts if not hasattr(layer.self_attn, p)] + \
                [p for p in self.mlp_parts if not hasattr(layer.mlp, p)]
            if missing:
                return f"a layer without {', '.join(missing)}"
        for rope_type in self.rope_types():
            if rope_type in BATCH_DEPENDENT_ROPE:
                return f"RoPE type {rope_type!r} (its frequencies depend on the longest sequence of the batch)"
        types = self.layer_types()
        if types is not None and set(types) - {"full_attention", "sliding_attention"}:
            return f"layer types {sorted(set(types) - {'full_attention', 'sliding_attention'})}"
        if getattr(self.config, "attn_logit_softcapping", None):
            return "attention logit softcapping"
        if getattr(self.config, "use_bidirectional_attention", False):
            return "bidirectional attention"
        return self.rotary_refusal()

    def rotary_refusal(self) -> str | None:
        """RoPE over the whole head (partial rotary factors are refused): checked on the tables
        themselves, whatever the config calls it."""
        x = torch.zeros(1, 1, 1, dtype=next(self.model.parameters()).dtype)
        positions = torch.zeros(1, 1, dtype=torch.long)
        try:
            with torch.no_grad():
                tables = self.rope_tables(x.to(self.device), positions.to(self.device))
        except Exception as exc:  # a RoPE module this family does not know how to call
            return f"its rotary embedding could not be called ({type(exc).__name__}: {exc})"
        for cos, _ in tables.values():
            if cos.shape[-1] != self.head_dim:
                return f"RoPE over {cos.shape[-1]} of {self.head_dim} head dimensions (partial rotary)"
        return None

    @property
    def device(self):
        return next(self.model.parameters()).device

    def rope_types(self) -> list[str]:
        """The RoPE types of the config: `rope_parameters` flat, or one dict per layer type (Gemma 3)."""
        params = getattr(self.config, "rope_parameters", None) or getattr(self.config, "rope_scaling", None) or {}
        if not isinstance(params, dict):
            return []
        if "rope_type" in params or "type" in params:
            return [params.get("rope_type", params.get("type"))]
        return [p.get("rope_type", p.get("type", "default")) for p in params.values() if isinstance(p, dict)]

    def layer_types(self) -> list[str] | None:
        return getattr(self.config, "layer_types", None)

    # ---- how it runs ---------------------------------------------------------------------------
    def windows(self) -> list[int | None]:
        """Each layer's sliding window: `sliding_window` on the layers `layer_types` marks sliding, or
        on every layer where the config has no layer types (Mistral, Phi-3)."""
        n = len(self.decoder.layers)
        window = getattr(self.config, "sliding_window", None) or None
        types = self.layer_types()
        if types is None:
            return [window] * n
        return [window if t == "sliding_attention" else None for t in types[:n]]

    def attention_scale(self) -> float:
        return self.head_dim ** -0.5

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(ids)

    def rope_tables(self, x: torch.Tensor, positions: torch.Tensor) -> dict:
        """transformers' cos and sin [B, T, d] for each RoPE table the blocks name."""
        return {None: self.decoder.rotary_emb(x, positions)}

    def final_norm(self) -> Callable:
        return rms_norm_of(self.decoder.norm)

    def blocks(self) -> list[Block]:
        raise NotImplementedError


# ---- shared parts -------------------------------------------------------------------------------
def fuse(modules) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) stacking the modules' along the output dimension. The modules' own weights
    become views into the fused one, so nothing is stored twice and transformers' forward (used for
    the transformers-path features: activations) still works."""
    weight = torch.cat([m.weight for m in modules], dim=0).contiguous()
    has_bias = [m.bias is not None for m in modules]
    bias = None
    if any(has_bias):
        bias = torch.cat([m.bias if m.bias is not None else torch.zeros(m.weight.shape[0], dtype=weight.dtype,
                          device=weight.device) for m in modules]).contiguous()
    start = 0
    for m in modules:
        rows = m.weight.shape[0]
        m.weight = torch.nn.Parameter(weight[start:start + rows], requires_grad=False)
        if m.bias is not None:
            m.bias = torch.nn.Parameter(bias[start:start + rows], requires_grad=False)
        start += rows
    return weight, bias


def rms_norm_of(module):
    """The module's RMSNorm (`weight * normalized`) as one op (torch's rms_norm: float32 statistics),
    without a module call's overhead; other norms stay modules. In float32 it gives transformers'
    numbers; in bfloat16 it applies the weight before the one rounding instead of after it (within a
    bfloat16 step)."""
    eps, weight = _eps_of(module), getattr(module, "weight", None)
    if not type(module).__name__.endswith("RMSNorm") or eps is None or weight is None:
        return module

    shape = (weight.shape[-1],)

    def norm(x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, shape, weight, eps)

    return norm


def offset_rms_norm_of(module):
    """Gemma's RMSNorm: `normalized * (1 + weight)`, all in float32, rounded once to the input's dtype
    (as transformers computes it). (1 + weight) is taken once, in float32."""
    eps = _eps_of(module)
    scale = 1.0 + module.weight.detach().float()
    shape = (scale.shape[-1],)

    def norm(x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), shape, scale, eps).to(x.dtype)

    return norm


def head_norms(q_norm, k_norm, heads: int, kv_heads: int, offset: bool = False):
    """The per-head RMSNorms of queries and keys (Qwen 3, Gemma 3) as one op on the fused [B, T, H + KV, d]
    layout: normalize each head, then one product with the query weight on the H query heads and the
    key weight on the KV key heads. `offset`: Gemma's (1 + weight) in float32, rounded once."""
    eps = _eps_of(q_norm)
    if _eps_of(k_norm) != eps:
        raise ValueError("query and key norms with different epsilons")
    qw, kw = q_norm.weight.detach(), k_norm.weight.detach()
    d = qw.shape[-1]
    if offset:
        weight = torch.cat([(1.0 + qw.float()).expand(heads, d), (1.0 + kw.float()).expand(kv_heads, d)])

        def norm(qk: torch.Tensor) -> torch.Tensor:
            return (F.rms_norm(qk.float(), (d,), None, eps) * weight).to(qk.dtype)
    else:
        weight = torch.cat([qw.expand(heads, d), kw.expand(kv_heads, d)])

        def norm(qk: torch.Tensor) -> torch.Tensor:  # transformers: weight * normalized.to(dtype)
            return F.rms_norm(qk, (d,), None, eps) * weight

    return norm


def _eps_of(module):
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def activation_of(name: str | None, module) -> Callable:
    """The MLP's activation as a plain function where it is one torch op; else transformers' module."""
    if name == "silu":
        return F.silu
    if name == "gelu_pytorch_tanh":
        return functools.partial(F.gelu, approximate="tanh")
    return module
