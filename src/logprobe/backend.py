"""The seam between the HTTP API and whatever runs the model.

The API hands over `GenerationRequest`s (a prompt's token ids, its sampling parameters, what to return)
and gets back `GenerationOutput`s (or, streaming, `Delta`s then a `StreamEnd`). Everything here is plain
data (numpy arrays, strings, numbers): picklable, so it crosses a process boundary as it is (Ray Serve
replicas, cluster/ray_app.py), and free of torch, so `logprobe.api` and `logprobe.output` import without
it. `Backend` is what the API needs of a model server; the engine (engine/engine.py) implements it in
process, `cluster.ray_backend.RayBackend` through Ray Serve, and the API tests use a fake one.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .tokens import TokenTable


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


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    STOP = "stop"


@dataclass
class PositionColumns:
    """What a request asked for at each position beyond its token's log probability (docs/api.md,
    section 2.3), one row per position: for the prompt, row i describes position i (row 0 is empty:
    nothing predicts the first token); for a choice, one row per kept generated token. A column is
    None when the request did not ask for it. Log probabilities and ranks are those of the raw
    distribution; `token_id_logprobs_processed` (generated rows, `logprobs_mode` other than raw, with
    `logprobs`) holds the asked ids' log probabilities in the distribution the token was drawn from."""

    token_ids: np.ndarray | None = None  # [K] int64, the asked ids (logprob_token_ids)
    position_ids: np.ndarray | None = None  # [N, K] int64, prompt row i's own ids (position_token_ids), 0-padded;
    # with it, token_id_logprobs and token_id_ranks row i describe position_ids row i
    token_id_logprobs: np.ndarray | None = None  # [N, K] float32
    token_id_ranks: np.ndarray | None = None  # [N, K] int64
    token_id_logprobs_processed: np.ndarray | None = None  # [N, K] float32
    entropy: np.ndarray | None = None  # [N] float32, nats (position_stats)
    ranks: np.ndarray | None = None  # [N] int64, the actual token's rank (generated rows; the prompt's are PromptColumns.ranks)
    top_p: float | None = None  # top_logprobs_p
    top_p_ids: np.ndarray | None = None  # [N, cap] int64, the likeliest first; entries past top_p_counts are padding
    top_p_logprobs: np.ndarray | None = None  # [N, cap] float32
    top_p_counts: np.ndarray | None = None  # [N] int64, tokens in each set
    top_p_mass: np.ndarray | None = None  # [N] float32, their probability mass
    top_p_truncated: np.ndarray | None = None  # [N] bool, the cap cut the set short of p

    def rows(self, start: int, stop: int) -> "PositionColumns":
        """The same columns for rows start..stop (the kept tokens of a choice)."""
        out = PositionColumns(token_ids=self.token_ids, top_p=self.top_p)
        for name in ROW_COLUMNS:
            column = getattr(self, name)
            if column is not None:
                setattr(out, name, column[start:stop])
        return out


ROW_COLUMNS = ("token_id_logprobs", "token_id_ranks", "token_id_logprobs_processed", "entropy", "ranks", "top_p_ids",
               "top_p_logprobs", "top_p_counts", "top_p_mass", "top_p_truncated")


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
    extras: PositionColumns | None = None  # asked ids and statistics at each prompt position


@dataclass
class ModelInfo:
    """What the API tells about the served model."""

    name: str
    aliases: list[str]
    num_layers: int
    d_model: int
    vocab_size: int
    context_length: int
    dtype: str
    bos_token: str | None
    eos_token: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    adds_bos: bool
    has_chat_template: bool
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    quantization: str | None = None  # "int4": decode steps of few rows read 4-bit weights
    runner: str = "transformers"  # "lean": logprobe's own batched forward; "transformers": the model's own


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


# ---- what comes back -----------------------------------------------------------------------------


@dataclass
class ChoiceOutput:
    """One finished choice. The token columns hold the kept tokens: those before a stop string's cut."""

    index: int
    token_ids: np.ndarray  # [T] int64
    logprobs: np.ndarray  # [T] float32, each token's log probability where it was sampled
    top_ids: np.ndarray  # [T, k] int64, the k likeliest tokens at each step (k = params.logprobs)
    top_logprobs: np.ndarray  # [T, k] float32
    offsets: list[int]  # each kept token's start in the choice's text (from request.text_start)
    text: str  # the generated text (cut before a stop string)
    finish_reason: str
    num_generated: int  # every token generated, the cut ones included (usage counts them)
    residual: dict[int, np.ndarray] | None = None  # layer -> [prompt + kept tokens, d_model] float32
    # logit lens: layer -> the columns of prompt + kept tokens under that layer's residual stream read
    # through the final norm and the head (row i: token i's log probability, rank and the top-k there)
    lens: dict[int, PromptColumns] | None = None
    extras: PositionColumns | None = None  # asked ids and statistics at each kept token
    # logprobs_mode "both": the same columns in the distribution each token was drawn from (with the
    # "processed" mode, `logprobs` and `top_logprobs` above hold those numbers themselves)
    processed_logprobs: np.ndarray | None = None  # [T] float32
    processed_top_logprobs: np.ndarray | None = None  # [T, k] float32, of the tokens in top_ids
    # return_unmodified: the columns of prompt + kept tokens from a pass without the request's
    # interventions (row i: token i's log probability, rank and the top-k there)
    unmodified: PromptColumns | None = None
    # ... a steered request's processed distribution has its own k likeliest (None: those of top_ids)
    processed_top_ids: np.ndarray | None = None  # [T, k] int64
    # a masked request (allowed_token_ids, bad_words, a grammar) with logprobs: log of the raw probability
    # mass of the tokens the mask allowed at each kept token's position (0: nothing was masked there)
    constraint_logprobs: np.ndarray | None = None  # [T] float32


@dataclass
class TokenTree:
    """A token tree (`GenerationRequest.tree`) as columns, one row per node in breadth-first order (a
    node's children are consecutive, in their processed order, the likeliest first)."""

    parents: np.ndarray  # [N] int64: the parent's row, -1 for the prompt's children
    depths: np.ndarray  # [N] int64: 1 for the prompt's children
    token_ids: np.ndarray  # [N] int64
    logprobs: np.ndarray  # [N] float32: raw log probability after the parent's path
    processed_logprobs: np.ndarray  # [N] float32: in the distribution tokens are drawn from there
    cumulative_logprobs: np.ndarray  # [N] float64: raw log probabilities summed along the path
    ranks: np.ndarray  # [N] int64: 1 + the raw distribution's tokens strictly likelier
    entropies: np.ndarray  # [N] float32: of the raw distribution the token is in (its parent's), nats
    is_stop: np.ndarray  # [N] bool: a stop token (end of text): not expanded
    num_forward_tokens: int = 0  # tokens run through the model: the prompt, then each expanded node once


@dataclass
class GenerationOutput:
    request_id: str
    num_prompt_tokens: int
    prompt_columns: PromptColumns | None  # when the request asked for prompt log probabilities
    choices: list[ChoiceOutput]
    tree: TokenTree | None = None  # a tree request's answer (then `choices` is empty)

    @property
    def num_generated(self) -> int:
        if self.tree is not None:
            return len(self.tree.token_ids)
        return sum(c.num_generated for c in self.choices)


@dataclass
class Delta:
    """What one choice sends in one streamed chunk: the tokens released since the last one, with the
    text they complete. While stop strings are set, the last (longest stop - 1) characters are held
    back, so that the streamed text and tokens always equal the answer without streaming."""

    group_index: int  # which request of the stream (a prompt of a completions request)
    seq_index: int  # which choice of it
    is_first: bool
    text: str
    token_ids: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    offsets: list[int]
    finish_reason: str | None
    prompt_columns: PromptColumns | None = None  # on a choice's first delta, when the prompt was scored
    constraint_logprobs: np.ndarray | None = None  # a masked request's (ChoiceOutput.constraint_logprobs)
    # logprobs_mode "both": the processed columns of the same tokens (ChoiceOutput's processed_*)
    processed_logprobs: np.ndarray | None = None
    processed_top_ids: np.ndarray | None = None  # [T, k] the processed top-k's ids (top_ids when unsteered)
    processed_top_logprobs: np.ndarray | None = None


@dataclass
class StreamEnd:
    """The last item of a stream: every request finished (usage is read from it)."""

    num_prompt_tokens: list[int]
    num_generated: list[int]


# ---- the backend ---------------------------------------------------------------------------------


class RequestAborted(Exception):
    """The request was stopped by `Backend.abort` before it finished."""


class RequestConflict(Exception):
    """The request's own settings leave nothing to generate, found only while it runs (its masks allow no
    token at some position: `allowed_token_ids`, `bad_words`, a constraint and `min_tokens` disagree).
    The request's fault, not the backend's: the API answers 400 with `message`, naming the fields, and
    the engine does not count it as a failure."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message, param)  # both in `args`: it pickles across a process (Ray Serve)
        self.message = message
        self.param = param

    def __str__(self) -> str:
        return self.message


class BackendUnavailable(Exception):
    """The backend could not run a request for a reason of its own, not the request's (a replica's
    process died under it): the API answers 503."""


@runtime_checkable
class Backend(Protocol):
    """A model server as the API sees it.

    - `info`, `tokenizer` (a transformers tokenizer: the API tokenizes, renders chat templates and
      checks lengths before anything is queued) and `table` (each token's text and bytes);
    - `run`: run requests to the end; cancelling the awaiting task aborts them (the backend drops them
      before their next step). Raises the request's error, or BackendUnavailable;
    - `stream`: the same, as an async iterator of lists of `Delta` (one list per step that released
      something) ending with a `StreamEnd`; closing the iterator early aborts the requests;
    - `abort`: stop the requests with this id wherever they are;
    - `stats`: numbers for /health and /metrics: `in_flight`, `steps`, `kv_cache_bytes`, `failing`,
      `step_failures`, `request_failures` and, after a failure, `last_error` ({"type", "at"});
    - `generated`: the tokens generated so far by the running requests with this id (what a request
      abandoned mid-run is charged beside its prompt), or None where the backend cannot tell (replicas);
    - `steps_here`: whether the model's steps run in this process. Then `observe` gives the callbacks the
      backend calls after each step, `on_step(seconds, rows)`, and after each failure,
      `on_failure("step" | "request")`, on its own thread, and `collector` is None. A backend whose steps run
      elsewhere (Ray Serve replicas) ignores `observe` and brings its metrics as a Prometheus
      `collector`.
    """

    info: ModelInfo
    tokenizer: Any
    table: TokenTable
    steps_here: bool

    async def run(self, requests: list[GenerationRequest]) -> list[GenerationOutput]: ...

    def stream(self, requests: list[GenerationRequest], k: int) -> AsyncIterator[list[Delta] | StreamEnd]: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict: ...

    def generated(self, request_id: str) -> int | None: ...

    def observe(self, on_step: Callable[[float, int], None] | None,
                on_failure: Callable[[str], None] | None) -> None: ...

    def collector(self) -> Any | None: ...


def finished_without_forward(request: GenerationRequest) -> GenerationOutput:
    """The answer to a request that asks for nothing the model computes (max_tokens 0, no prompt
    log probabilities, no activations): every choice ends at once with `length`."""
    k = request.params.logprobs or 0
    empty = ChoiceOutput(0, np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros((0, k), np.int64),
                         np.zeros((0, k), np.float32), [], "", FinishReason.LENGTH.value, 0)
    choices = [ChoiceOutput(**{**empty.__dict__, "index": j}) for j in range(request.params.n)]
    return GenerationOutput(request.request_id, request.num_prompt_tokens, None, choices)
