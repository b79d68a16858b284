"""Server settings: one schema for CLI flags and LOGPROBE_* environment variables."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields


@dataclass
class Limits:
    """The size caps of API.md section 8. Each is a server option; /v1/models/{model} reports them."""

    max_logprobs: int = 100  # logprobs, prompt_logprobs k, top_logprobs
    max_vocab_positions: int = 256  # prompt_logprobs -1: prompt tokens x n, summed over prompts
    max_vocab_positions_with_residual: int = 16
    max_prompt_logprob_positions: int = 32_768  # prompt_logprobs k >= 0, or echo with logprobs
    max_residual_vectors: int = 65_536
    max_n: int = 16
    max_prompts: int = 256
    max_body_bytes: int = 16 * 1024 * 1024
    max_stop: int = 4

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class Settings:
    model: str | None = None
    aliases: list[str] = field(default_factory=list)
    chat_template: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    limits: Limits = field(default_factory=Limits)


def env_default(name: str, default):
    """A flag's default from LOGPROBE_<NAME>, converted to the default's type."""
    raw = os.environ.get("LOGPROBE_" + name.upper().replace("-", "_"))
    if raw is None:
        return default
    return type(default)(raw) if default is not None else raw
