"""Two models' next-token distributions over one vocabulary, compared position by position (POST
/v1/compare): KL divergence both ways, Jensen-Shannon divergence, and each model's likeliest token.

The rows come from the engines as float32 log probabilities; everything here is computed in float64.
Each row is renormalized in float64 first (a float32 log-softmax row sums to 1 only within float32
rounding, ~1e-7, which would otherwise leave divergences of that size between equal distributions), and
what float64 rounding leaves below zero (~1e-16) is set to zero: a divergence is never negative. A token
with probability zero (log probability -inf) contributes nothing (0 log 0 = 0); a token that p gives
mass and q rules out makes KL(p||q) infinite. Jensen-Shannon is always finite (at most ln 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

CHUNK_ENTRIES = 1 << 20  # rows are compared a few at a time: ~8 MB per float64 temporary, whatever P x V


@dataclass
class Divergences:
    """One entry per compared row; p is the first model's distribution, q the second's."""

    kl_pq: np.ndarray  # [N] float64, nats: KL(p||q) = sum p (log p - log q); +inf where q rules out p's mass
    kl_qp: np.ndarray  # [N] float64, nats: KL(q||p)
    js: np.ndarray  # [N] float64, nats: (KL(p||m) + KL(q||m)) / 2 with m = (p + q) / 2
    top1_p: np.ndarray  # [N] int64, p's likeliest token (the lowest id among equals)
    top1_q: np.ndarray  # [N] int64


def divergences(logp: np.ndarray, logq: np.ndarray) -> Divergences:
    """Compare two [N, V] arrays of log probabilities row by row (any float dtype; -inf for zero)."""
    if logp.shape != logq.shape or logp.ndim != 2:
        raise ValueError(f"two [N, V] arrays of one shape are needed, not {logp.shape} and {logq.shape}")
    num, vocab = logp.shape
    out = Divergences(np.empty(num), np.empty(num), np.empty(num), np.argmax(logp, axis=1).astype(np.int64),
                      np.argmax(logq, axis=1).astype(np.int64))
    step = max(1, CHUNK_ENTRIES // max(1, vocab))
    for start in range(0, num, step):
        rows = slice(start, min(num, start + step))
        lp, lq = _renormalized(logp[rows]), _renormalized(logq[rows])
        out.kl_pq[rows] = _kl(lp, lq)
        out.kl_qp[rows] = _kl(lq, lp)
        out.js[rows] = 0.5 * (_kl_to_mixture(lp, lq) + _kl_to_mixture(lq, lp))
    return out


def _renormalized(rows: np.ndarray) -> np.ndarray:
    """float64 log probabilities whose probabilities sum to 1 in float64."""
    rows = rows.astype(np.float64)
    top = rows.max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        return rows - (top + np.log(np.exp(rows - top).sum(axis=1, keepdims=True)))


def _kl(la: np.ndarray, lb: np.ndarray) -> np.ndarray:
    """sum a (log a - log b) per row: 0 where a is 0, +inf where a > 0 and b is 0."""
    with np.errstate(invalid="ignore", over="ignore"):
        terms = np.exp(la) * (la - lb)
    terms = np.where(np.isneginf(la), 0.0, np.where(np.isneginf(lb), np.inf, terms))
    return np.maximum(terms.sum(axis=1), 0.0)


def _kl_to_mixture(la: np.ndarray, lb: np.ndarray) -> np.ndarray:
    """KL(a || (a + b) / 2) per row, from log a - log m = ln 2 - log(1 + b / a): exactly 0 for equal rows
    (log((a + b) / 2) computed as such would leave ~1e-17), ln 2 a where b is 0, 0 where a is 0."""
    with np.errstate(invalid="ignore"):
        terms = np.exp(la) * (math.log(2.0) - np.logaddexp(0.0, lb - la))
    terms = np.where(np.isneginf(la), 0.0, terms)
    return np.maximum(terms.sum(axis=1), 0.0)


def mean_or_none(values: np.ndarray) -> float | None:
    """The mean of a column (inf if any entry is), None for an empty one."""
    return float(values.mean()) if len(values) else None
