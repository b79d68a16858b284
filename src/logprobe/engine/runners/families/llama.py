"""Llama, Mistral and Qwen2 (and what shares their layout: SmolLM, TinyLlama, ...): separate q/k/v and
gate/up projections, fused here; RMSNorm before the attention and before the MLP; SiLU; one RoPE table.
Sliding windows where the config has them: Mistral's on every layer, Qwen2's on the layers
`layer_types` marks sliding."""

from __future__ import annotations

from .base import Block, Family, activation_of, fuse, rms_norm_of

INT4_NAMES = (["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
              ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"])


class Llama(Family):
    name = "llama"
    model_types = frozenset({"llama", "mistral", "qwen2"})

    def blocks(self) -> list[Block]:
        act_name = getattr(self.config, "hidden_act", None)
        out = []
        for layer, window in zip(self.decoder.layers, self.windows()):
            attn, mlp = layer.self_attn, layer.mlp
            out.append(Block(
                qkv=fuse([attn.q_proj, attn.k_proj, attn.v_proj]), o_proj=attn.o_proj,
                gate_up=fuse([mlp.gate_proj, mlp.up_proj]), down_proj=mlp.down_proj,
                input_norm=rms_norm_of(layer.input_layernorm), pre_ff_norm=rms_norm_of(layer.post_attention_layernorm),
                act=activation_of(act_name, mlp.act_fn), qk_norm=self.qk_norm(attn), window=window,
                int4_names=INT4_NAMES))
        return out

    def qk_norm(self, attn):
        """The norm on query and key heads before RoPE (none in Llama's layout)."""
        return None
