"""Choosing the next token. Sampling settings shape the choice only: the log probabilities the API
reports are always taken from the raw distribution (`log_softmax` of the logits in float32)."""

from __future__ import annotations

import torch

from .request import SamplingParams


def sample_row(logprobs: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick one token from a row of raw log probabilities ([V], float32)."""
    if params.is_greedy:
        return int(torch.argmax(logprobs))
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
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
