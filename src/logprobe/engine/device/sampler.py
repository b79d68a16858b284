"""Choosing the next token, for every row of a batch at once, on the device the log probabilities are on.

Sampling settings shape the choice only: the log probabilities the API reports are taken from the raw
distribution (`log_softmax` of the logits in float32), unless a request asks (`logprobs_mode`) for the
distribution the token was drawn from, which `sample_with_distribution` returns from the very scores
`sample_batch` draws from.

A non-greedy row is drawn as torch.multinomial draws one sample: each token's probability over an
exponential random number, the largest wins (an exact draw from the distribution). A row's V numbers
come from the top 31 bits of the first V outputs of SplitMix64 started at the row's seed for this step
(the choice's counter-based stream gives that seed, random_streams.py), computed for every row at once in
64-bit integer tensor operations (`_log_uniform`): the same bits on any device (the float32 logarithm
made from them may differ in its last bit between a CPU and a GPU), in any batch, with no generator
state and no per-row work on the host, so the draw can run inside a recorded CUDA graph. A seeded row draws the same token in a batch
of one or of sixty-four, and a tiny change of its probabilities (another batch shape rounds differently)
changes the token only where two tokens' ratios tie that closely. (Inverting the cumulative sum at one
uniform number per row would need V fewer numbers, but there a change of 1e-6 in the sum below a token
moves the draw to a token next to it in the vocabulary's order: under load that flipped seeded
answers.) Rows of different settings share one pass: a top-k or top-p that a row does not ask for
changes nothing in it.

`pick` is what a decode step brings to the host: each row's token, its log probability and the top-k,
packed in one array, which picks.split_picks cuts into a named `Pick` per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...backend import SamplingParams
from ..host.random_streams import _GAMMA, _MASK  # SplitMix64's increment, and 64 bits
from .top_k import top_k


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    value &= _MASK
    return value - (1 << 64) if value >> 63 else value


_M1, _M2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)  # SplitMix64's multipliers

# settings table columns (one int64 row per batch row; floats as their 64-bit patterns)
GREEDY, TOP_K, SEED, TEMPERATURE, TOP_P = range(5)
SETTINGS_COLUMNS = 5


@dataclass
class BatchSettings:
    """The sampling settings of a batch's rows as device tensors (None where no row needs them)."""

    greedy: torch.Tensor | None  # [B] bool (None when every row is greedy, as the other tensors)
    temperature: torch.Tensor | None  # [B, 1] float32 (1 for greedy rows: they are not drawn)
    top_k: torch.Tensor | None  # [B, 1] int64, 0 where a row keeps every token
    top_p: torch.Tensor | None  # [B, 1] float32, +inf where a row keeps every token
    all_greedy: bool
    max_top_k: int
    seeds: torch.Tensor | None = None  # [B] int64: each row's seed for this step, from its stream

    @staticmethod
    def table(params: list[SamplingParams], vocab: int, seeds: list[int] | None) -> np.ndarray:
        """The rows' settings as one int64 array [B, 5] (columns GREEDY, TOP_K, SEED, TEMPERATURE, TOP_P;
        the two floats as their float64 bit patterns), which moves to the device in one copy."""
        out = np.zeros((len(params), SETTINGS_COLUMNS), dtype=np.int64)
        greedy = np.array([p.is_greedy for p in params], dtype=bool)
        out[:, GREEDY] = greedy
        out[:, TOP_K] = [p.top_k if not g and 0 < p.top_k < vocab else 0 for p, g in zip(params, greedy)]
        if seeds is not None:
            out[:, SEED] = [_signed(s) for s in seeds]
        floats = np.empty((len(params), 2), dtype=np.float64)
        floats[:, 0] = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        floats[:, 1] = [p.top_p if not g and p.top_p < 1.0 else np.inf for p, g in zip(params, greedy)]
        out[:, TEMPERATURE:TOP_P + 1] = floats.view(np.int64)
        return out

    @classmethod
    def of(cls, params: list[SamplingParams], vocab: int, device, seeds: list[int] | None = None) -> "BatchSettings":
        """The rows' settings moved to the device in one copy; `seeds` seed the rows' random numbers."""
        if all(p.is_greedy for p in params):  # nothing is drawn: no settings need the device
            return cls.all_greedy_rows()
        table = cls.table(params, vocab, seeds)
        return cls.on_device(to_device(table, torch.int64, device), max_top_k=int(table[:, TOP_K].max()),
                             top_p=bool(np.isfinite(table[:, TOP_P].view(np.float64)).any()))

    @classmethod
    def all_greedy_rows(cls) -> "BatchSettings":
        return cls(greedy=None, temperature=None, top_k=None, top_p=None, all_greedy=True, max_top_k=0)

    @classmethod
    def on_device(cls, table: torch.Tensor, max_top_k: int, top_p: bool) -> "BatchSettings":
        """Settings read from a table already on the device (`table`'s layout): tensors only, nothing
        read back, so a recorded CUDA graph can take its rows' settings from a buffer. `max_top_k` (the
        largest top-k of a row, 0 for none) and `top_p` (whether any row asks for it) come from the host;
        a filter no row asks for is left out."""
        top_k = max_top_k > 0
        return cls(greedy=table[:, GREEDY] != 0, temperature=table[:, TEMPERATURE].view(torch.float64).float()[:, None],
                   top_k=table[:, TOP_K:TOP_K + 1] if top_k else None,
                   top_p=table[:, TOP_P].view(torch.float64).float()[:, None] if top_p else None,
                   all_greedy=False, max_top_k=max_top_k, seeds=table[:, SEED])


_COUNTERS: dict[tuple, torch.Tensor] = {}


def _counters(vocab: int, device) -> torch.Tensor:
    """[V] int64: (i + 1) * gamma modulo 2**64 for each token i, SplitMix64's state increments."""
    key = (vocab, str(device))
    if key not in _COUNTERS:
        steps = np.arange(1, vocab + 1, dtype=np.uint64) * np.uint64(_GAMMA)  # wraps modulo 2**64
        _COUNTERS[key] = torch.from_numpy(steps.view(np.int64)).to(device)
    return _COUNTERS[key]


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical shift right of 64-bit patterns held in int64 (torch shifts arithmetically), in one new
    tensor (these are [B, V]: on a CPU a temporary of that size costs as much as the operation)."""
    shifted = z >> bits
    return shifted.bitwise_and_((1 << (64 - bits)) - 1)


def _mixed(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] int64: SplitMix64's state for each row's first V outputs (the row's seed, [B] int64, plus
    (i + 1) * gamma), through the output function's first two rounds. int64 products wrap modulo 2**64
    on every device torch runs on; the shifts are logical."""
    z = seeds[:, None] + _counters(vocab, seeds.device)
    z ^= _shr(z, 30)
    z *= _M1
    z ^= _shr(z, 27)
    z *= _M2
    return z


def splitmix64(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] int64: for each row, the first V outputs of SplitMix64 whose state starts at the row's seed,
    as 64-bit patterns. (The sampler reads only their top 31 bits, which the last round, z ^ z >> 31,
    leaves as they are: it skips that round.)"""
    z = _mixed(seeds, vocab)
    z ^= _shr(z, 31)
    return z


def _log_uniform(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] float32 log(1 - v) = -E for each row's SplitMix64 outputs: v in (0, 1) from an output's top
    31 bits, E = -log(1 - v) an exponential random number (kept negative: the draw divides by it as it is).
    Small E, where the draws of unlikely tokens are decided, keeps its full resolution of 2**-31; v
    rounding to 1 in float32 gives E = inf (that token cannot win this draw)."""
    return _shr(_mixed(seeds, vocab), 33).float().mul_(-2.0 ** -31).add_(-2.0 ** -32).log1p_()


def noise(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] float32 exponential random numbers, the ones `draw` uses for each row."""
    return _log_uniform(seeds, vocab).neg_()


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A small host list (or array) as a device tensor without waiting for the device: on a GPU the copy goes
    from pinned memory, queued behind the work already launched (a plain copy from pageable memory
    synchronizes the stream)."""
    tensor = torch.from_numpy(values).to(dtype) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def filtered_scores(logprobs: torch.Tensor, settings: BatchSettings) -> torch.Tensor:
    """The scores non-greedy rows are drawn from ([B, V]): the raw log probabilities over the
    temperature, with the tokens top-k and top-p leave out at -inf. Their softmax is the sampling
    distribution. (Greedy rows get their raw scores: they are not drawn.)"""
    # the likeliest token's score is 0, never -inf
    scores = (logprobs - logprobs.max(dim=-1, keepdim=True).values).div_(settings.temperature)
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


def draw(scores: torch.Tensor, settings: BatchSettings) -> torch.Tensor:
    """[B] int64: one token per row from softmax(scores): the largest probability over its exponential
    random number E. `scores` have their largest at 0 (`filtered_scores`), so exp(scores) is the
    probability times a factor of the row, which changes no choice; over -E it is the most negative."""
    return torch.argmin(torch.exp(scores).div_(_log_uniform(settings.seeds, scores.shape[-1])), dim=-1)


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


def pick(logprobs: torch.Tensor, settings: BatchSettings, k: int) -> torch.Tensor:
    """What a decode step brings to the host for rows of raw log probabilities ([B, V], float32), as one
    float64 array [B, 2 + 2k] (ids and float32 values are exact in float64): each row's token
    (`sample_batch`), its log probability, then the ids and log probabilities of the k likeliest (the
    columns picks.py names and `split_picks` reads)."""
    tokens = sample_batch(logprobs, settings)
    parts = [tokens[:, None].double(), logprobs.gather(1, tokens[:, None]).double()]
    if k:
        values, ids = top_k(logprobs, k)
        parts += [ids.double(), values.double()]
    return torch.cat(parts, dim=1)
