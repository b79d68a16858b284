"""Gemma 3 text models (Gemma3ForCausalLM: gemma-3-270m, gemma-3-1b; model_type "gemma3_text").

What differs from Llama's layout:
* RMSNorm with (1 + weight), computed in float32 and rounded once, in four places per block: before
  the attention, on the attention's output (before the residual add), before the MLP and on the MLP's
  output; and on each query and key head before RoPE.
* embeddings scaled by sqrt(hidden_size) in the embedding's dtype (transformers' scaled embedding module
  is called as it is);
* attention scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5;
* gelu_pytorch_tanh;
* `layer_types`: sliding-window layers (`sliding_window`) with their own RoPE table (local base
  frequency), full-attention layers with the global one (and its scaling, if any);
* a tied head; final logit softcapping when the config has it (the runner applies it to every row).

Refused: attention logit softcapping (Gemma 2's; none in Gemma 3 configs) and bidirectional attention
(`Family.refusal`). The multimodal Gemma3ForConditionalGeneration (model_type "gemma3") is not claimed:
it runs on transformers' forward."""

from __future__ import annotations

from .base import Block, Family, activation_of, fuse, head_norms, offset_rms_norm_of
from .llama import INT4_NAMES


class Gemma3(Family):
    name = "gemma3"
    model_types = frozenset({"gemma3_text"})

    def refusal(self) -> str | None:
        reason = super().refusal()
        if reason is None:
            for layer in self.decoder.layers:
                for owner, part in ((layer.self_attn, "q_norm"), (layer.self_attn, "k_norm"),
                                    (layer, "pre_feedforward_layernorm"), (layer, "post_feedforward_layernorm")):
                    if not hasattr(owner, part):
                        return f"a layer without {part}"
        return reason

    def attention_scale(self) -> float:
        return float(self.config.query_pre_attn_scalar) ** -0.5

    def rope_tables(self, x, positions) -> dict:
        return {t: self.decoder.rotary_emb(x, positions, t) for t in sorted(set(self.layer_types()))}

    def final_norm(self):
        return offset_rms_norm_of(self.decoder.norm)

    def blocks(self) -> list[Block]:
        act_name = getattr(self.config, "hidden_activation", None) or getattr(self.config, "hidden_act", None)
        out = []
        for layer, window, kind in zip(self.decoder.layers, self.windows(), self.layer_types()):
            attn, mlp = layer.self_attn, layer.mlp
            out.append(Block(
                qkv=fuse([attn.q_proj, attn.k_proj, attn.v_proj]), o_proj=attn.o_proj,
                gate_up=fuse([mlp.gate_proj, mlp.up_proj]), down_proj=mlp.down_proj,
                input_norm=offset_rms_norm_of(layer.input_layernorm),
                post_attn_norm=offset_rms_norm_of(layer.post_attention_layernorm),
                pre_ff_norm=offset_rms_norm_of(layer.pre_feedforward_layernorm),
                post_ff_norm=offset_rms_norm_of(layer.post_feedforward_layernorm),
                act=activation_of(act_name, mlp.act_fn),
                qk_norm=head_norms(attn.q_norm, attn.k_norm, self.num_heads, self.kv_heads, offset=True),
                rope=kind, window=window, int4_names=INT4_NAMES))
        return out
