"""Phi-3 (microsoft/Phi-3-mini-4k-instruct's layout): q/k/v already fused in `qkv_proj` and gate/up in
`gate_up_proj` (gate first), RMSNorm before the attention and before the MLP, SiLU, one RoPE table over
the whole head, and `sliding_window` on every layer (2047 in that checkpoint).

Refused (transformers' forward runs them): longrope scaling (the 128k checkpoints: its factors switch on
the longest position of the batch) and partial rotary factors (Phi-4-mini), found by `Family.refusal`."""

from __future__ import annotations

from .base import Block, Family, activation_of, rms_norm_of


class Phi3(Family):
    name = "phi3"
    model_types = frozenset({"phi3"})
    attention_parts = ("qkv_proj", "o_proj")
    mlp_parts = ("gate_up_proj", "down_proj")

    def blocks(self) -> list[Block]:
        act_name = getattr(self.config, "hidden_act", None)
        names = (["self_attn.qkv_proj"], ["self_attn.o_proj"], ["mlp.gate_up_proj"], ["mlp.down_proj"])
        out = []
        for layer, window in zip(self.decoder.layers, self.windows()):
            attn, mlp = layer.self_attn, layer.mlp
            out.append(Block(
                qkv=(attn.qkv_proj.weight, attn.qkv_proj.bias), o_proj=attn.o_proj,
                gate_up=(mlp.gate_up_proj.weight, mlp.gate_up_proj.bias), down_proj=mlp.down_proj,
                input_norm=rms_norm_of(layer.input_layernorm), pre_ff_norm=rms_norm_of(layer.post_attention_layernorm),
                act=activation_of(act_name, mlp.activation_fn), window=window, int4_names=names))
        return out
