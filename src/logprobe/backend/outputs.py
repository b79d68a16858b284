"""What a backend hands back: a `GenerationOutput` per request (each choice's tokens, log probabilities
and columns, the prompt's columns), or streaming, `Delta`s then a `StreamEnd`."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from .requests import GenerationRequest


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
    # prompt tokens served from the prefix cache, not computed (usage's prompt_tokens_details.cached_tokens)
    num_cached_tokens: int = 0

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
    """The last item of a stream: every request finished (usage is read from it). A stream without
    deltas (`Backend.stream(requests, None)`: a request answered whole) carries every request's
    `GenerationOutput` here, in the order of the requests."""

    num_prompt_tokens: list[int]
    num_generated: list[int]
    num_cached_tokens: list[int] | None = None  # per request, as GenerationOutput's (None: 0 each)
    outputs: list[GenerationOutput] | None = None

    @classmethod
    def of(cls, outputs: list[GenerationOutput]) -> "StreamEnd":
        """The end of a stream without deltas: its counts read off the outputs."""
        return cls([o.num_prompt_tokens for o in outputs], [o.num_generated for o in outputs],
                   [o.num_cached_tokens for o in outputs], outputs)


def finished_without_forward(request: GenerationRequest) -> GenerationOutput:
    """The answer to a request that asks for nothing the model computes (max_tokens 0, no prompt
    log probabilities, no activations): every choice ends at once with `length`."""
    k = request.params.logprobs or 0
    empty = ChoiceOutput(0, np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros((0, k), np.int64),
                         np.zeros((0, k), np.float32), [], "", FinishReason.LENGTH.value, 0)
    choices = [ChoiceOutput(**{**empty.__dict__, "index": j}) for j in range(request.params.n)]
    return GenerationOutput(request.request_id, request.num_prompt_tokens, None, choices)
