"""Prompt columns from hidden states: what both runners report for a prompt's positions.

Logits are made only for the groups that ask, in chunks of positions, so that a long prompt never holds a
[P, V] float32 matrix; each chunk is reduced on the device to what the API reports (the target's log
probability, its rank and the top-k, and the instruments' extras) before anything moves to numpy.
"""

from __future__ import annotations

from typing import Callable, Generator, Iterator, TypeVar

import numpy as np
import torch

from ..device.instruments import count_greater, fill_prompt_extras, new_prompt_extras
from ..device.top_k import top_k
from .interventions import Edits
from ..host.request import PromptColumns, SamplingParams

POSITION_CHUNK = 256  # prompt positions whose logits are materialised at once, at most
CHUNK_ENTRIES = 256 * 49_152  # ... and at most this many logits (positions x vocabulary): 48 positions
# for Gemma 3's 262,144 tokens, whose working memory at 256 positions measured 3.49 GB against 0.69 GB


T = TypeVar("T")


def drain(steps: Generator[int, None, T]) -> T:
    """Run a pass given as steps (a generator that yields at each point where it may be paused: after a
    block, before a run of the head) to its end, and return what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


class CaptureDone(Exception):
    """Raised once the deepest asked layer's activations are read: the rest of the pass is not needed."""


def vocab_ranks(rows: torch.Tensor) -> torch.Tensor:
    """Rank of every entry of [B, V] rows: 1 + the number of strictly larger values in its row.
    One sort per row; equal values share the rank of the first of their run."""
    values, order = torch.sort(rows, dim=-1, descending=True)
    starts_run = torch.ones_like(values, dtype=torch.bool)
    starts_run[:, 1:] = values[:, 1:] != values[:, :-1]
    index = torch.arange(rows.shape[-1], device=rows.device).expand_as(order)
    first = torch.cummax(torch.where(starts_run, index, torch.zeros_like(index)), dim=-1).values
    return torch.empty_like(first).scatter_(-1, order, first + 1)


class PromptColumnWriter:
    """Fills a prompt's columns from hidden states with a runner's head (`logprobs_of`: hidden [C, D] ->
    float32 log probabilities [C, V])."""

    def __init__(self, logprobs_of: Callable[[torch.Tensor], torch.Tensor], vocab_size: int):
        self.logprobs_of = logprobs_of
        self.vocab_size = vocab_size
        self.chunk_positions = max(1, min(POSITION_CHUNK, CHUNK_ENTRIES // vocab_size))  # positions a head run takes

    def new(self, num: int, params: SamplingParams) -> PromptColumns:
        """Empty columns for a prompt of `num` tokens, as wide as the request asks."""
        k, vocab = params.num_prompt_top, self.vocab_size
        full = full_ranks = None
        if params.prompt_logprobs == -1:  # bounded by the whole-vocabulary cap (256 positions by default)
            full = np.full((num, vocab), np.nan, dtype=np.float32)
            full_ranks = np.zeros((num, vocab), dtype=np.int32)
        return PromptColumns(np.full(num, np.nan, dtype=np.float32), np.zeros(num, dtype=np.int64),
                             np.zeros((num, k), dtype=np.int64), np.zeros((num, k), dtype=np.float32),
                             full, full_ranks, new_prompt_extras(num, params, vocab))

    def whole(self, hidden: torch.Tensor, ids: torch.Tensor, params: SamplingParams) -> PromptColumns:
        """The columns of a prompt `ids` [P] whose every position's state is in `hidden` [P, D]."""
        return drain(self.whole_steps(hidden, ids, params))

    def whole_steps(self, hidden: torch.Tensor, ids: torch.Tensor, params: SamplingParams,
                    chunk: int | None = None) -> Generator[int, None, PromptColumns]:
        """`whole` as steps (`fill_steps`)."""
        cols = self.new(ids.shape[0], params)
        yield from self.fill_steps(cols, hidden, ids, 0, chunk)
        return cols

    def fill(self, cols: PromptColumns, hidden: torch.Tensor, ids: torch.Tensor, first: int) -> None:
        """Fill the rows predicted by `hidden` ([C, D], the states at positions first..first+C-1): the
        distribution at position i predicts the prompt token at i + 1."""
        drain(self.fill_steps(cols, hidden, ids, first))

    def fill_steps(self, cols: PromptColumns, hidden: torch.Tensor, ids: torch.Tensor, first: int,
                   chunk: int | None = None) -> Iterator[int]:
        """`fill` as steps: yields 0 before each run of the head, over `chunk` positions at most (fewer
        than `chunk_positions` where a pass that others may pause wants short runs)."""
        num, k = ids.shape[0], cols.top_ids.shape[1]
        last = min(first + hidden.shape[0], num - 1)  # the state at the final position predicts no prompt token
        chunk = min(chunk or self.chunk_positions, self.chunk_positions)
        for start in range(first, last, chunk):
            stop = min(start + chunk, last)
            yield 0
            logprobs = self.logprobs_of(hidden[start - first:stop - first])  # [C, V]
            target = ids[start + 1:stop + 1]
            target_lp = logprobs.gather(1, target[:, None])  # [C, 1]
            cols.logprobs[start + 1:stop + 1] = target_lp[:, 0].cpu().numpy()
            if cols.full is not None:
                cols.full[start + 1:stop + 1] = logprobs.cpu().numpy()
                cols.full_ranks[start + 1:stop + 1] = vocab_ranks(logprobs).cpu().numpy()
            cols.ranks[start + 1:stop + 1] = (count_greater(logprobs, target_lp) + 1).cpu().numpy()
            if k:
                vals, idx = top_k(logprobs, k)
                cols.top_ids[start + 1:stop + 1] = idx.cpu().numpy()
                cols.top_logprobs[start + 1:stop + 1] = vals.cpu().numpy()
            if cols.extras is not None:
                fill_prompt_extras(cols.extras, logprobs, slice(start + 1, stop + 1))


def copy_rows(source: PromptColumns, target: PromptColumns, start: int, stop: int) -> None:
    """Rows start..stop-1 of every per-position array of `source` into `target` (same settings)."""
    for name in ("logprobs", "ranks", "top_ids", "top_logprobs", "full", "full_ranks"):
        array = getattr(source, name)
        if array is not None:
            getattr(target, name)[start:stop] = array[start:stop]
    if source.extras is not None:
        for name, array in vars(source.extras).items():
            if isinstance(array, np.ndarray) and name not in ("token_ids", "position_ids"):
                getattr(target.extras, name)[start:stop] = array[start:stop]


def logit_lens(runner, ids: list[int], layers: list[int], k: int, edits: Edits | None = None
               ) -> dict[int, PromptColumns]:
    """{layer: columns of `ids`} with each asked layer's residual stream (`runner.residual_stream`) read as
    if it were the last block's output: the runner's final norm, its head, log_softmax in float32. Row i
    holds token i's log probability and rank under the state at position i - 1 and the k likeliest
    tokens there (row 0 is empty), reduced chunk by chunk as prompt log probabilities are."""
    states = runner.residual_stream(ids, layers, edits)
    dtype = runner.head_dtype()
    target = torch.tensor(ids, dtype=torch.long, device=runner.device)
    params = SamplingParams(prompt_logprobs=k)
    out = {}
    for layer in layers:
        hidden = torch.from_numpy(states[layer]).to(runner.device, dtype)  # float32 of the model's values
        cols = runner.columns.new(len(ids), params)
        runner.columns.fill(cols, runner.apply_final_norm(hidden), target, 0)
        out[layer] = cols
    return out
