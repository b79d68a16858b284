"""Qwen 3 (dense): Llama's layout with an RMSNorm on each query and key head before RoPE, an explicit
head_dim (not hidden / heads), and Qwen2's per-layer sliding windows where the config turns them on."""

from __future__ import annotations

from .base import head_norms
from .llama import Llama


class Qwen3(Llama):
    """Llama's blocks with the per-head query and key norms."""

    name = "qwen3"
    model_types = frozenset({"qwen3"})

    def refusal(self) -> str | None:
        reason = super().refusal()
        if reason is None and not all(hasattr(layer.self_attn, "q_norm") and hasattr(layer.self_attn, "k_norm")
                                      for layer in self.decoder.layers):
            reason = "a layer without q_norm and k_norm"
        return reason

    def qk_norm(self, attn):
        return head_norms(attn.q_norm, attn.k_norm, self.num_heads, self.kv_heads)
