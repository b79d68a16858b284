"""What the engine knows about a request: its parameters, its sequences and their output columns.

The API layer turns a validated HTTP request into `SequenceGroup`s (one per prompt, each holding the
request's `n` choices). The engine fills numpy columns; the output layer turns columns into bytes.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from .tokenizer import TextAssembler, TokenTable


@dataclass
class SamplingParams:
    """Everything the engine needs to run one prompt's choices."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: frozenset[int] = frozenset()
    logprobs: int | None = None  # top-k for generated tokens (None: no logprobs)
    echo: bool = False
    prompt_logprobs: int | None = None  # top-k for prompt positions (-1: whole vocabulary)
    residual_layers: tuple[int, ...] = ()  # layers (0..num_layers) whose residual stream to return

    @property
    def is_greedy(self) -> bool:
        """Temperatures below 1e-5 are greedy, as in vLLM (dividing by them overflows)."""
        return self.temperature < 1e-5

    @property
    def num_prompt_top(self) -> int:
        """Top-k width needed at prompt positions."""
        ks = [self.prompt_logprobs if self.prompt_logprobs and self.prompt_logprobs > 0 else 0]
        if self.echo and self.logprobs is not None:
            ks.append(self.logprobs)
        return max(0, *ks)

    @property
    def needs_forward(self) -> bool:
        """False only for a request that asks for nothing the model computes (max_tokens 0, no prompt
        log probabilities, no activations): it is answered without the engine."""
        return self.max_tokens > 0 or self.needs_prompt_logits or bool(self.residual_layers)

    @property
    def needs_prompt_logits(self) -> bool:
        return self.prompt_logprobs is not None or (self.echo and self.logprobs is not None)


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    STOP = "stop"


@dataclass
class PromptColumns:
    """Log probabilities of the prompt's own tokens. Row i describes position i (row 0 is empty: no
    token comes before the first one)."""

    logprobs: np.ndarray  # [P] float32, nan at 0
    ranks: np.ndarray  # [P] int64, 0 at 0
    top_ids: np.ndarray  # [P, k] int64
    top_logprobs: np.ndarray  # [P, k] float32
    full: np.ndarray | None = None  # [P, V] float32, every token's log probability (prompt_logprobs -1)
    full_ranks: np.ndarray | None = None  # [P, V] int32, their ranks


def _make_generator(seed: int | None, index: int) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.manual_seed(int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1))
    else:
        # One stream per choice, fixed by (seed, index): the same whatever else the server runs.
        gen.manual_seed((int(seed) * 1_000_003 + index) & ((1 << 63) - 1))
    return gen


class Sequence:
    """One choice: the tokens it generated, their log probabilities and its text so far."""

    def __init__(self, index: int, params: SamplingParams, table: TokenTable, text_start: int):
        self.index = index
        self.generator = _make_generator(params.seed, index)
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_ids: list[np.ndarray] = []
        self.top_logprobs: list[np.ndarray] = []
        self.text = TextAssembler(table, start=text_start)
        self.finish_reason: FinishReason | None = None
        self.num_kept: int | None = None  # tokens kept after a stop string cut the text
        self.text_end: int | None = None  # length of the generated text after the cut
        self.residual: dict[int, np.ndarray] | None = None  # layer -> [prompt + kept tokens, D]

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_kept_tokens(self) -> int:
        return len(self.token_ids) if self.num_kept is None else self.num_kept

    def columns(self, k: int, start: int = 0, stop: int | None = None):
        """(ids, logprobs, top ids [., k], top logprobs [., k]) of kept tokens start..stop. Streaming
        asks for just the new tokens, so a long stream does not re-stack its history every step."""
        kept = len(self.token_ids) if self.num_kept is None else self.num_kept
        stop = kept if stop is None else min(stop, kept)
        start = min(start, stop)
        ids = np.asarray(self.token_ids[start:stop], dtype=np.int64)
        lps = np.asarray(self.logprobs[start:stop], dtype=np.float32)
        if stop > start and k:
            top_ids = np.stack(self.top_ids[start:stop])[:, :k]
            top_lps = np.stack(self.top_logprobs[start:stop])[:, :k]
        else:
            top_ids = np.zeros((stop - start, k), dtype=np.int64)
            top_lps = np.zeros((stop - start, k), dtype=np.float32)
        return ids, lps, top_ids, top_lps


class SequenceGroup:
    """One prompt and its `n` choices; the unit the scheduler prefills and decodes."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 table: TokenTable, text_start: int = 0):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.sequences = [Sequence(j, params, table, text_start) for j in range(params.n)]
        self.prompt_columns: PromptColumns | None = None
        self.cache = None  # the model's KV cache while the group runs
        self.active_rows: list[int] = []  # sequence index of each row of the KV cache batch
        self.is_aborted = False
        self.error: BaseException | None = None
        self.on_finish = None  # callable, set by the engine's async front
        self.on_step = None  # callable(group), run on the engine thread after each step (streaming)

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.sequences)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)
