"""The k likeliest entries of a row in one order whatever the call holds (engine/device/top_k.py):
largest value first, equal values by ascending id, the smallest ids kept where equal values straddle
the k-th place; checked against a plain sort of (value, id) pairs, and for one row in calls of 1 to 64
rows (torch.topk alone orders equal values otherwise as the row count changes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from logprobe.engine.device.top_k import _settled, top_k


def reference(rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.stack([np.lexsort((np.arange(row.size), -row))[:k] for row in rows])
    return np.take_along_axis(rows, ids, axis=1), ids


def tied_rows(n: int, vocab: int, levels: int, seed: int) -> torch.Tensor:
    """Rows whose values come from `levels` distinct numbers: ties everywhere, at the k-th place too."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, levels, (n, vocab), generator=gen).float().mul(-0.5)


@pytest.mark.parametrize("levels", [2, 5, 40, 1 << 20])
@pytest.mark.parametrize("k", [1, 3, 5, 20])
def test_against_a_sort_of_value_and_id(levels, k):
    rows = tied_rows(9, 3000, levels, seed=levels + k)
    want_values, want_ids = reference(rows.numpy(), k)
    for values, ids in (top_k(rows, k), _settled(rows, torch.topk(rows, k, dim=-1).values, k)):
        np.testing.assert_array_equal(ids.numpy(), want_ids)
        np.testing.assert_array_equal(values.numpy(), want_values)


def test_rows_with_fewer_finite_entries_than_k():
    rows = torch.full((3, 50), float("-inf"))
    rows[0, [7, 3]] = -1.0
    rows[1, 40] = -0.5
    rows[2, [9, 8, 30]] = torch.tensor([-2.0, -2.0, -0.1])
    values, ids = top_k(rows, 5)
    want_values, want_ids = reference(rows.numpy(), 5)
    np.testing.assert_array_equal(ids.numpy(), want_ids)
    assert ids[0].tolist() == [3, 7, 0, 1, 2] and ids[2].tolist() == [30, 8, 9, 0, 1]
    np.testing.assert_array_equal(values.numpy(), want_values)


def test_a_row_keeps_its_ids_whatever_the_call_holds():
    """A bfloat16-like row (values of 8 significant bits over 49,152 tokens), first, in the middle and last
    of calls of 1 to 64 rows: the same values and ids each time, those of the sort."""
    gen = torch.Generator().manual_seed(3)
    row = torch.randn(49152, generator=gen).bfloat16().float().log_softmax(-1).bfloat16().float()
    want_values, want_ids = reference(row[None].numpy(), 20)
    for n in (1, 2, 3, 4, 7, 16, 33, 64):
        for place in sorted({0, n // 2, n - 1}):
            rows = torch.randn(n, 49152, generator=gen).bfloat16().float()
            rows[place] = row
            values, ids = top_k(rows, 20)
            np.testing.assert_array_equal(ids[place].numpy(), want_ids[0], err_msg=f"{n} rows, row {place}")
            np.testing.assert_array_equal(values[place].numpy(), want_values[0])


def test_untied_rows_take_topk_as_it_is():
    rows = torch.randn(4, 1000, generator=torch.Generator().manual_seed(1))
    values, ids = top_k(rows, 10)
    plain = torch.topk(rows, 10, dim=-1)
    assert torch.equal(values, plain.values) and torch.equal(ids, plain.indices)
