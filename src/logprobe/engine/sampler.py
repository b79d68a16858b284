"""Choosing the next token. Sampling settings shape the choice only: the log probabilities the API
reports are taken from the raw distribution (`log_softmax` of the logits in float32), unless a request
asks (`logprobs_mode`) for the distribution the token was drawn from, which `sample_with_distribution`
returns from the very scores `sample_row` draws from."""

from __future__ import annotations

import torch

from ..backend import SamplingParams


def filtered_scores(logprobs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The scores a non-greedy row is drawn from ([V]): the raw log probabilities over the temperature,
    with the tokens top-k and top-p leave out at -inf. Their softmax is the sampling distribution."""
    scores = (logprobs - logprobs.max()) / params.temperature  # the likeliest token's score is 0, never -inf
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        before = torch.cumsum(probs, dim=-1) - probs
        drop = before >= params.top_p
        drop[0] = False  # a top_p that rounds to 0 in float32 still keeps the likeliest token
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.empty_like(scores).scatter_(0, order, sorted_scores)
    return scores


def draw(scores: torch.Tensor, generator: torch.Generator) -> int:
    """One token from the distribution softmax(scores)."""
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def sample_row(logprobs: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick one token from a row of raw log probabilities ([V], float32)."""
    if params.is_greedy:
        return int(torch.argmax(logprobs))
    return draw(filtered_scores(logprobs, params), generator)


def sample_with_distribution(logprobs: torch.Tensor, params: SamplingParams,
                             generator: torch.Generator) -> tuple[int, torch.Tensor]:
    """`sample_row`'s token (the same token, the same random numbers drawn) and the log probabilities
    ([V], float32) of the distribution it was drawn from: log_softmax of the filtered scores, -inf for
    the tokens filtered out; for a greedy row, a point mass (0 for the token, -inf elsewhere)."""
    if params.is_greedy:
        token = int(torch.argmax(logprobs))
        distribution = torch.full_like(logprobs, float("-inf"))
        distribution[token] = 0.0
        return token, distribution
    scores = filtered_scores(logprobs, params)
    return draw(scores, generator), torch.log_softmax(scores, dim=-1)
