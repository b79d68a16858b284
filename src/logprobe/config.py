"""Server settings: one schema for CLI flags and LOGPROBE_* environment variables."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields


@dataclass
class Limits:
    """The size caps (docs/api.md, section 8). Each is a server option; /v1/models/{model} reports them."""

    max_logprobs: int = 100  # logprobs, prompt_logprobs k, top_logprobs
    max_vocab_positions: int = 256  # prompt_logprobs -1: prompt tokens x n, summed over prompts
    max_vocab_positions_with_residual: int = 16
    # prompt_logprobs -1: positions x vocabulary entries; 256 positions of Llama 3's 128,256 tokens. A model's
    # whole-vocabulary position cap is min(the two caps above, max_vocab_entries // its vocabulary).
    max_vocab_entries: int = 256 * 128_256
    max_prompt_logprob_positions: int = 32_768  # prompt_logprobs k >= 0, or echo with logprobs
    max_residual_vectors: int = 65_536
    max_lens_rows: int = 8192  # output_lens: positions x layers x n, each a pass of the head
    max_logprob_token_ids: int = 128  # logprob_token_ids: ids asked at every position
    max_top_p_tokens: int = 100  # top_logprobs_p: tokens of one position's set (more: truncated)
    max_interventions: int = 16  # interventions: changes to the residual stream in one request
    max_n: int = 16
    max_prompts: int = 256
    max_body_bytes: int = 16 * 1024 * 1024
    max_stop: int = 4
    max_json_depth: int = 64  # nesting of the JSON body
    max_header_bytes: int = 8192  # all request headers together (431 over it)
    max_tokens_in_flight: int = 131_072  # the hold: (prompt + max_tokens) x n of every admitted request

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def vocab_positions(self, vocab_size: int, residual: bool = False) -> tuple[int, str]:
        """(the most prompt tokens x n a `prompt_logprobs: -1` request may have on a model with this
        vocabulary, the cap that sets it)."""
        cap, flag = ((self.max_vocab_positions_with_residual, "max_vocab_positions_with_residual") if residual
                     else (self.max_vocab_positions, "max_vocab_positions"))
        by_entries = self.max_vocab_entries // max(1, vocab_size)
        return (by_entries, "max_vocab_entries") if by_entries < cap else (cap, flag)


@dataclass
class ModelSpec:
    """One served model: where it comes from (as --model takes it) and the names it answers to besides
    its own."""

    source: str | None = None  # None: the bundled model
    aliases: list[str] = field(default_factory=list)


@dataclass
class Settings:
    model: str | None = None  # the first model (--model), kept for one-model callers
    aliases: list[str] = field(default_factory=list)  # the first model's --alias values
    models: list[ModelSpec] = field(default_factory=list)  # every --model with its aliases (in order)
    chat_template: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    quantization: str = "none"  # "int4": 4-bit decode weights (engine/int4.py)
    max_model_len: int = 0  # 0: the model's context length; less: serve a shorter context (vLLM's option)
    kv_cache_positions: int = 256  # positions per slot the batched KV cache starts with (it doubles, then shrinks back when idle)
    prefix_cache_mb: int = 256  # prompt prefixes' keys and values kept across prompt-only batches (0: off)
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    limits: Limits = field(default_factory=Limits)
    admission: "AdmissionSettings" = field(default_factory=lambda: AdmissionSettings())
    api_keys: list[str] = field(default_factory=list)
    # Replicas on Ray Serve (cluster/ray_app.py); "" is one process
    replicas: str = ""  # "N", or "MIN:MAX" to autoscale
    ray_address: str | None = None  # join this Ray cluster; None starts a local one bound to 127.0.0.1
    cpus_per_replica: float = 1.0  # CPU cores Ray reserves for each replica (torch uses as many threads)
    ray_cpus: int = 0  # a local Ray's CPUs (0: this machine's)
    max_ongoing_per_replica: int = 64  # requests Serve sends one replica at once; more wait for a free one

    def model_specs(self) -> list[ModelSpec]:
        """Every model to serve: `models`, or the one of `model` and `aliases`."""
        return list(self.models) or [ModelSpec(self.model, list(self.aliases))]


@dataclass
class AdmissionSettings:
    """The hold (docs/serving.md) and the time limits around it."""

    tokens_per_minute: int = 0  # per API key (0: no budget); one shared budget when no key is configured
    max_queue: int = 256  # requests waiting for their hold; one more gets 429
    queue_timeout: float = 30.0  # seconds a request may wait for its hold before 429
    request_timeout: float = 600.0  # seconds a request may run once admitted (0: no limit)
    drain_timeout: float = 30.0  # on SIGTERM: seconds to finish running requests before exiting


def env_default(name: str, default):
    """A flag's default from LOGPROBE_<NAME>, converted to the default's type."""
    raw = os.environ.get("LOGPROBE_" + name.upper().replace("-", "_"))
    if raw is None:
        return default
    return type(default)(raw) if default is not None else raw


def read_api_keys(cli_keys: list[str], key_file: str | None) -> list[str]:
    """Keys from --api-key (repeatable), LOGPROBE_API_KEY (comma-separated) and --api-key-file (one per
    line; blank lines and lines starting with # are skipped)."""
    keys = [k.strip() for k in cli_keys if k.strip()]
    keys += [k.strip() for k in os.environ.get("LOGPROBE_API_KEY", "").split(",") if k.strip()]
    if key_file:
        with open(key_file, encoding="utf-8") as fh:
            keys += [line.strip() for line in fh if line.strip() and not line.lstrip().startswith("#")]
    return list(dict.fromkeys(keys))
