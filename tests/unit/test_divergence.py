"""output/divergence.py: KL both ways, Jensen-Shannon and top-1 per row, against the definitions written
out term by term, with zero probabilities, equal and disjoint rows, ties and chunking."""

from __future__ import annotations

import math

import numpy as np
import pytest

from logprobe.output import divergence
from logprobe.output.divergence import divergences


def log_rows(probs) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(np.asarray(probs, dtype=np.float64))


def kl_terms(p, q) -> float:
    """sum over tokens of p log(p / q), one term at a time: 0 where p = 0, inf where only q is 0."""
    total = 0.0
    for a, b in zip(p, q):
        if a == 0:
            continue
        if b == 0:
            return math.inf
        total += a * math.log(a / b)
    return total


def js_terms(p, q) -> float:
    m = [(a + b) / 2 for a, b in zip(p, q)]
    return 0.5 * kl_terms(p, m) + 0.5 * kl_terms(q, m)


def test_random_rows_match_the_definitions():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 40)) * 3
    other = logits + rng.standard_normal((5, 40))
    lp = (logits - np.log(np.exp(logits).sum(1, keepdims=True))).astype(np.float32)
    lq = (other - np.log(np.exp(other).sum(1, keepdims=True))).astype(np.float32)
    got = divergences(lp, lq)
    for i in range(5):
        p = np.exp(lp[i].astype(np.float64))
        q = np.exp(lq[i].astype(np.float64))
        p, q = p / p.sum(), q / q.sum()
        assert got.kl_pq[i] == pytest.approx(kl_terms(p, q), rel=1e-12)
        assert got.kl_qp[i] == pytest.approx(kl_terms(q, p), rel=1e-12)
        assert got.js[i] == pytest.approx(js_terms(p, q), rel=1e-12)
        assert (got.top1_p[i], got.top1_q[i]) == (np.argmax(lp[i]), np.argmax(lq[i]))
    assert got.kl_pq.dtype == np.float64 and got.top1_p.dtype == np.int64


def test_zero_probabilities():
    p = [0.5, 0.5, 0.0, 0.0]
    q = [0.25, 0.25, 0.5, 0.0]  # token 3: zero in both (0 log 0 = 0); token 2: only p rules it out
    got = divergences(log_rows([p]), log_rows([q]))
    assert got.kl_pq[0] == pytest.approx(math.log(2), rel=1e-14)
    assert got.kl_qp[0] == math.inf
    assert got.js[0] == pytest.approx(js_terms(p, q), rel=1e-14)
    assert 0 < got.js[0] < math.log(2)
    assert not np.isnan(got.kl_pq).any() and not np.isnan(got.js).any()


def test_equal_and_disjoint_rows():
    same = log_rows([[0.7, 0.2, 0.1, 0.0]])
    got = divergences(same, same.copy())
    assert (got.kl_pq[0], got.kl_qp[0], got.js[0]) == (0.0, 0.0, 0.0)
    logits = np.random.default_rng(3).standard_normal((50, 49152)).astype(np.float32) * 4  # log((p+p)/2) != log p
    rows = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    got = divergences(rows, rows.copy())  # the same model twice: exactly 0 everywhere, JS included
    assert not got.kl_pq.any() and not got.kl_qp.any() and not got.js.any()
    got = divergences(log_rows([[0.5, 0.5, 0, 0]]), log_rows([[0, 0, 0.9, 0.1]]))
    assert got.kl_pq[0] == got.kl_qp[0] == math.inf
    assert got.js[0] == pytest.approx(math.log(2), rel=1e-14)  # the most it can be


def test_rows_are_renormalized_in_float64():
    """float32 rows that sum to 1 only within rounding: never a negative divergence."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((64, 1000)).astype(np.float32)
    lp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    shifted = lp + np.float32(3e-7)  # the same distribution, its mass off by 3e-7
    got = divergences(lp, shifted)
    assert np.all(got.kl_pq >= 0) and np.all(got.kl_qp >= 0) and np.all(got.js >= 0)
    assert np.abs(got.kl_pq).max() < 1e-12


def test_ties_pick_the_lowest_id():
    row = log_rows([[0.1, 0.4, 0.4, 0.1]])
    got = divergences(row, row[:, ::-1].copy())
    assert (got.top1_p[0], got.top1_q[0]) == (1, 1)


def test_chunks_give_the_same_numbers(monkeypatch):
    rng = np.random.default_rng(2)
    lp = rng.standard_normal((37, 50))
    lq = rng.standard_normal((37, 50))
    lp -= np.log(np.exp(lp).sum(1, keepdims=True))
    lq -= np.log(np.exp(lq).sum(1, keepdims=True))
    whole = divergences(lp, lq)
    monkeypatch.setattr(divergence, "CHUNK_ENTRIES", 120)  # two rows a chunk
    chunked = divergences(lp, lq)
    for name in ("kl_pq", "kl_qp", "js", "top1_p", "top1_q"):
        np.testing.assert_array_equal(getattr(whole, name), getattr(chunked, name))


def test_no_rows_and_wrong_shapes():
    got = divergences(np.zeros((0, 8), np.float32), np.zeros((0, 8), np.float32))
    assert len(got.kl_pq) == len(got.top1_q) == 0
    assert divergence.mean_or_none(got.js) is None
    with pytest.raises(ValueError):
        divergences(np.zeros((2, 8)), np.zeros((2, 9)))
