"""Choosing the next token, for every row of a batch at once, on the device the log probabilities are on.

Sampling settings shape the choice only: the log probabilities the API reports are taken from the raw
distribution (`log_softmax` of the logits in float32), unless a request asks (`logprobs_mode`) for the
distribution the token was drawn from, which `sample_with_distribution` returns from the very scores
`sample_batch` draws from.

A non-greedy row is drawn as torch.multinomial draws one sample: each token's probability over an
exponential random number, the largest wins (an exact draw from the distribution). The row's numbers
come from the device's own generator seeded for this row and this step by the choice's counter-based
stream (streams.py), so a seeded row draws the same token in a batch of one or of sixty-four, and a
tiny change of its probabilities (another batch shape rounds differently) changes the token only where
two tokens' ratios tie that closely. (Inverting the cumulative sum at one uniform number per row would
need V fewer numbers, but there a change of 1e-6 in the sum below a token moves the draw to a token
next to it in the vocabulary's order: under load that flipped seeded answers.) Rows of different
settings share one pass: a top-k or top-p that a row does not ask for changes nothing in it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backend import SamplingParams


@dataclass
class BatchSettings:
    """The sampling settings of a batch's rows as device tensors (None where no row needs them)."""

    greedy: torch.Tensor | None  # [B] bool (None when every row is greedy, as the other tensors)
    temperature: torch.Tensor | None  # [B, 1] float32 (1 for greedy rows: they are not drawn)
    top_k: torch.Tensor | None  # [B, 1] int64, 0 where a row keeps every token
    top_p: torch.Tensor | None  # [B, 1] float32, +inf where a row keeps every token
    all_greedy: bool
    max_top_k: int
    greedy_rows: list[bool] | None = None

    seeds: list[int] | None = None  # each row's seed for this step, from its stream (None: all greedy)

    @classmethod
    def of(cls, params: list[SamplingParams], vocab: int, device, seeds: list[int] | None = None) -> "BatchSettings":
        """The rows' settings moved to the device in one copy; `seeds` seed the rows' random numbers."""
        greedy = [p.is_greedy for p in params]
        if all(greedy):  # nothing is drawn: no settings need the device
            return cls(greedy=None, temperature=None, top_k=None, top_p=None, all_greedy=True, max_top_k=0,
                       greedy_rows=greedy)
        top_k = [p.top_k if not g and 0 < p.top_k < vocab else 0 for p, g in zip(params, greedy)]
        top_p = [p.top_p if not g and p.top_p < 1.0 else float("inf") for p, g in zip(params, greedy)]
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        table = to_device(list(zip(greedy, temperature, top_k, top_p)), torch.float64, device)  # one copy
        return cls(greedy=table[:, 0] != 0, temperature=table[:, 1:2].float(),
                   top_k=table[:, 2:3].long() if any(top_k) else None,
                   top_p=table[:, 3:4].float() if any(p != float("inf") for p in top_p) else None,
                   all_greedy=all(greedy), max_top_k=max(top_k), seeds=seeds, greedy_rows=greedy)

    def noise(self, vocab: int, device) -> torch.Tensor:
        """[B, V] float32 exponential random numbers, each row from the device's generator seeded with its
        seed (one fill per sampled row; a greedy row's are ones: it is not drawn)."""
        q = torch.ones(len(self.seeds), vocab, device=device)
        gen = _generator(device)
        for row, (seed, greedy) in enumerate(zip(self.seeds, self.greedy_rows)):
            if not greedy:
                gen.manual_seed(seed)  # the fill takes the generator's state at its launch
                q[row].exponential_(generator=gen)
        return q.clamp_(min=torch.finfo(q.dtype).tiny)  # a 0 (possible in float32) wins, as its limit does


def to_device(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    """A small host list as a device tensor without waiting for the device: on a GPU the copy goes
    from pinned memory, queued behind the work already launched (a plain copy from pageable memory
    synchronizes the stream)."""
    tensor = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def filtered_scores(logprobs: torch.Tensor, settings: BatchSettings) -> torch.Tensor:
    """The scores non-greedy rows are drawn from ([B, V]): the raw log probabilities over the
    temperature, with the tokens top-k and top-p leave out at -inf. Their softmax is the sampling
    distribution. (Greedy rows get their raw scores: they are not drawn.)"""
    # the likeliest token's score is 0, never -inf
    scores = (logprobs - logprobs.max(dim=-1, keepdim=True).values) / settings.temperature
    if settings.top_k is not None:
        kept = torch.topk(scores, settings.max_top_k, dim=-1).values
        kth = kept.gather(-1, (settings.top_k - 1).clamp(min=0))
        kth = kth.masked_fill(settings.top_k == 0, float("-inf"))
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if settings.top_p is not None:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True, stable=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        before = torch.cumsum(probs, dim=-1) - probs
        drop = before >= settings.top_p
        drop[:, 0] = False  # a top_p that rounds to 0 in float32 still keeps the likeliest token
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.empty_like(scores).scatter_(-1, order, sorted_scores)
    return scores


_GENERATORS: dict[str, torch.Generator] = {}


def _generator(device) -> torch.Generator:
    """One generator per device, re-seeded for every row it fills (only the engine's thread samples)."""
    device = torch.device(device)
    key = str(device)
    if key not in _GENERATORS:
        _GENERATORS[key] = torch.Generator(device=device)
    return _GENERATORS[key]


def draw(scores: torch.Tensor, settings: BatchSettings) -> torch.Tensor:
    """[B] int64: one token per row from softmax(scores): the largest probability over its exponential
    random number."""
    noise = settings.noise(scores.shape[-1], scores.device)
    return torch.argmax(torch.softmax(scores, dim=-1) / noise, dim=-1)


def sample_batch(logprobs: torch.Tensor, settings: BatchSettings) -> torch.Tensor:
    """[B] int64 tokens on the device for rows of raw log probabilities ([B, V], float32)."""
    greedy = torch.argmax(logprobs, dim=-1)
    if settings.all_greedy:
        return greedy
    return torch.where(settings.greedy, greedy, draw(filtered_scores(logprobs, settings), settings))


def sample_with_distribution(logprobs: torch.Tensor, settings: BatchSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_batch`'s tokens (the same tokens, from the same numbers) and the log probabilities
    ([B, V], float32) of the distributions they were drawn from: log_softmax of the filtered scores,
    -inf for the tokens filtered out; for a greedy row, a point mass (0 for the token, -inf elsewhere)."""
    greedy = torch.argmax(logprobs, dim=-1)
    point = torch.full_like(logprobs, float("-inf")).scatter_(-1, greedy[:, None], 0.0)
    if settings.all_greedy:
        return greedy, point
    scores = filtered_scores(logprobs, settings)
    tokens = torch.where(settings.greedy, greedy, draw(scores, settings))
    return tokens, torch.where(settings.greedy[:, None], point, torch.log_softmax(scores, dim=-1))


def sample_row(logprobs: torch.Tensor, params: SamplingParams, seed: int) -> int:
    """One token for one row of raw log probabilities ([V]): `sample_batch` on a batch of one."""
    settings = BatchSettings.of([params], logprobs.shape[-1], logprobs.device, [seed])
    return int(sample_batch(logprobs[None], settings)[0])
