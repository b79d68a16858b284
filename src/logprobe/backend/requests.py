"""What the API hands a backend: a `GenerationRequest` (a prompt's token ids, its priority) and its
`SamplingParams` (how to pick, what to return), with the constraints, interventions and tree shapes
they may carry."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(eq=False)
class Intervention:
    """One change to the residual stream of a request's forward passes (docs/api.md, section 2.4), as
    the API validated it. At `layer` (0: entering block 0; l: leaving block l, as output_residual_stream
    numbers them) and at `positions` (token positions, prompt then generated; negative ones count from
    the prompt's end; None: every position), the stream x becomes x + vector ("add"), x * factor
    ("scale"; "zero" is factor 0) or vector ("set"). A "patch" is a "set" whose vector is another
    prompt's stream (`source_ids` at `source_position` of `source_layer`), computed by the engine."""

    layer: int
    op: str  # "add" | "scale" | "set" | "patch"
    positions: tuple[int, ...] | None = None
    vector: np.ndarray | None = None  # [d_model] float32 ("add", "set")
    factor: float = 1.0  # "scale"
    source_ids: tuple[int, ...] = ()  # "patch"
    source_position: int = -1
    source_layer: int | None = None  # None: `layer`
    source_text: str | None = None  # "patch" on a text: the API tokenizes it into source_ids


@dataclass(frozen=True)
class Constraint:
    """A grammar the generated text must follow (docs/api.md: response_format, structured_outputs), as the
    API checked it."""

    # "json_object" | "json_schema" | "regex" | "choice" | "grammar" (Lark); the engine also reads "chosen"
    # (a choice list decided before generation, engine/host/forced.py) and "tokens" (one sequence of it)
    kind: str
    source: str  # the schema as canonical JSON text, the regex, the choices as a JSON array text, the grammar
    # the body's field it came from, for messages only (not part of the grammar: compiled once for both)
    param: str = field(default="structured_outputs", compare=False)


@dataclass
class SamplingParams:
    """Everything the engine needs to run one prompt's choices."""

    max_tokens: int = 16
    min_tokens: int = 0  # no stop token or stop string ends a choice before it has this many tokens (vLLM)
    ignore_eos: bool = False  # stop tokens do not end a choice (vLLM); stop strings still do
    skip_special_tokens: bool = True  # special tokens write no text into the generated text (vLLM)
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
    lens_layers: tuple[int, ...] = ()  # logit lens: layers (0..num_layers) read through the final norm and head
    lens_top_k: int = 0  # ... with the k likeliest tokens at each position
    # The researcher's instruments (docs/api.md, section 2.3); none costs anything when not asked
    logprob_token_ids: tuple[int, ...] = ()  # these ids' log probabilities and ranks at every position
    position_token_ids: tuple[tuple[int, ...], ...] = ()  # ... or, per prompt position i, its own ids (row 0: none)
    position_stats: bool = False  # entropy and the actual token's rank at every position
    top_logprobs_p: float | None = None  # the smallest set of likeliest tokens whose mass reaches p
    max_top_p_tokens: int = 100  # ... at most this many tokens (the server's cap)
    logprobs_mode: str = "raw"  # "raw", "processed" (the distribution the token was drawn from) or "both"
    interventions: tuple[Intervention, ...] = ()  # changes to the residual stream, in order (docs/api.md, 2.4)
    return_unmodified: bool = False  # ... and the log probabilities of the same tokens without them
    # Steering (docs/api.md, section 2.5): what the token is drawn from, never what `raw` reports
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in -100..100) added to the raw log probs
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be drawn
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # token sequences that may not be completed
    constraint: Constraint | None = None  # a grammar the text follows

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
        log probabilities, no activations, no unmodified pass): it is answered without the engine."""
        return (self.max_tokens > 0 or self.needs_prompt_logits or bool(self.residual_layers)
                or bool(self.lens_layers) or self.return_unmodified)

    @property
    def needs_prompt_logits(self) -> bool:
        return (self.prompt_logprobs is not None or (self.echo and self.logprobs is not None)
                or self.needs_position_columns)

    @property
    def needs_position_columns(self) -> bool:
        """Whether prompt and generated positions carry `PositionColumns` (asked ids, statistics)."""
        return (bool(self.logprob_token_ids) or bool(self.position_token_ids) or self.position_stats
                or self.top_logprobs_p is not None)

    @property
    def is_steered(self) -> bool:
        """Whether something beyond temperature, top-k and top-p shapes the draw (engine/device/steering.py)."""
        return bool(self.logit_bias) or self.is_masked

    @property
    def is_masked(self) -> bool:
        """Whether some tokens may not be drawn (not a bias): the choice reports `constraint_logprobs`.
        `min_tokens` masks the stop tokens of a choice's first tokens."""
        return (self.allowed_token_ids is not None or bool(self.bad_words_ids) or self.constraint is not None
                or self.min_tokens > 0)

    @property
    def records_processed(self) -> bool:
        """Whether generated tokens need the log probabilities of the distribution they were drawn from."""
        return self.logprobs_mode != "raw" and self.logprobs is not None


# ---- what the API hands over ---------------------------------------------------------------------


@dataclass(frozen=True)
class TreeShape:
    """A token tree's request beyond its prompt (POST /v1/tree, docs/api.md): expand each node's
    likeliest children, ranked by the processed distribution (the one a token would be drawn from), to
    `depth` tokens below the prompt. Each node gets at most `branches` children; with `branch_p`, only
    the fewest likeliest whose processed probability reaches p (at most `branches`)."""

    depth: int
    branches: int
    branch_p: float | None = None

    @property
    def max_nodes(self) -> int:
        """Nodes of the full tree: branches + branches^2 + ... + branches^depth."""
        return sum(self.branches ** level for level in range(1, self.depth + 1))


INTERACTIVE, BATCH = "interactive", "batch"  # the values of GenerationRequest.priority


PRIORITIES = (INTERACTIVE, BATCH)


@dataclass
class GenerationRequest:
    """One prompt and its `params.n` choices (or, with `tree`, its token tree)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    text_start: int = 0  # where the generated text starts in the choice's text (after an echoed prompt)
    tree: TreeShape | None = None  # a token tree instead of choices (engine/host/tree.py)
    # "interactive" (an HTTP request) or "batch" (a line of a /v1/batches job): batch lines run in the
    # capacity interactive requests leave, in admission and in the engine's scheduler (docs/serving.md)
    priority: str = "interactive"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def held_tokens(self) -> int:
        """What admission holds for this request: (prompt tokens + max_tokens) x n. A request of
        several prompts holds the sum over them. A tree holds its prompt and every node it may have."""
        if self.tree is not None:
            return self.num_prompt_tokens + self.tree.max_nodes
        return (self.num_prompt_tokens + self.params.max_tokens) * self.params.n
