"""Model families of the lean runner, one file each: which models a family claims, how their weights fill
the runner's structures, and the configurations it refuses (those run on transformers' forward).

* llama.py: Llama, Mistral, Qwen2 (and SmolLM, TinyLlama...), with sliding windows where configured
* gemma3.py: Gemma 3 text models (Gemma3ForCausalLM)
* qwen3.py: Qwen 3 (dense)
* phi3.py: Phi-3 (the 4k checkpoints' configuration)
"""

from __future__ import annotations

from .base import Block, Family
from .gemma3 import Gemma3
from .llama import Llama
from .phi3 import Phi3
from .qwen3 import Qwen3

FAMILIES: tuple[type[Family], ...] = (Llama, Gemma3, Qwen3, Phi3)

__all__ = ["FAMILIES", "Block", "Family", "family_of"]


def family_of(model) -> tuple[Family | None, str]:
    """The family that runs `model` on the lean runner and its name, or None and why not."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    for cls in FAMILIES:
        if cls.claims(model):
            family = cls(model)
            reason = family.refusal()
            if reason is not None:
                return None, f"{type(model).__name__} ({model_type}): {reason}"
            return family, cls.name
    return None, f"{type(model).__name__} ({model_type}): no lean-runner family claims this architecture"
