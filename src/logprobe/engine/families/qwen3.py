"""Qwen 3 (dense): Llama's layout with an RMSNorm on each query and key head before RoPE, an explicit
head_dim (not hidden / heads), and Qwen2's per-layer sliding windows where the config turns them on."""

from __future__ import annotations

from .base import Block, Family, activation_of, fuse, head_norms, rms_norm_of
from .llama import INT4_NAMES


class Qwen3(Family):
    name = "qwen3"
    model_types = frozenset({"qwen3"})

    def refusal(self) -> str | None:
        reason = super().refusal()
        if reason is None and not all(hasattr(layer.self_attn, "q_norm") and hasattr(layer.self_attn, "k_norm")
                                      for layer in self.decoder.layers):
            reason = "a layer without q_norm and k_norm"
        return reason

    def blocks(self) -> list[Block]:
        act_name = getattr(self.config, "hidden_act", None)
        out = []
        for layer, window in zip(self.decoder.layers, self.windows()):
            attn, mlp = layer.self_attn, layer.mlp
            out.append(Block(
                qkv=fuse([attn.q_proj, attn.k_proj, attn.v_proj]), o_proj=attn.o_proj,
                gate_up=fuse([mlp.gate_proj, mlp.up_proj]), down_proj=mlp.down_proj,
                input_norm=rms_norm_of(layer.input_layernorm), pre_ff_norm=rms_norm_of(layer.post_attention_layernorm),
                act=activation_of(act_name, mlp.act_fn),
                qk_norm=head_norms(attn.q_norm, attn.k_norm, self.num_heads, self.kv_heads),
                window=window, int4_names=INT4_NAMES))
        return out
