"""The row floors the lean runner measures on the CPU it runs on (engine/runners/lean/row_floors.py): a
float32 product gives a row the same bits in a call of any row count, and attention pads a call's
queries so that no block of the kernel's query split holds fewer than the kernel's floor.

On an Intel Xeon under MKL's strict mode `F.linear` has no floor; on an AMD EPYC it gives a row of a
1-row call, and of a 2-3-row call, other bits than in calls of 4 or more, so the runner takes oneDNN's
product there (a floor of 2 rows) and pads. These tests hold on either: they check the property of what
the runner chose, not which it chose."""

from __future__ import annotations

import pytest
import torch

from logprobe.engine.runners.lean.row_floors import padded_queries, query_split
from logprobe.engine.runners.lean.weights import Linear

COUNTS = [*range(1, 21), 31, 32, 33, 64, 65, 130, 300]


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (3072, 576), (128, 64), (64, 128)])
def test_a_product_gives_a_row_the_same_bits_at_every_row_count(shape):
    """SmolLM2's qkv, down and gate_up shapes and a tiny model's: one row, first, in the middle and last of
    calls of 1 to 300 rows (and in a 3-d call, as a pass's [B, T, D] reaches the head), always the same bits."""
    n, k = shape
    gen = torch.Generator().manual_seed(n + k)
    linear = Linear(torch.randn(n, k, generator=gen) * 0.05, torch.randn(n, generator=gen), pack=False)
    probe = torch.randn(k, generator=gen)
    want = linear(probe[None])[0]
    for rows in COUNTS:
        for place in {0, rows // 2, rows - 1}:
            x = torch.randn(rows, k, generator=gen)
            x[place] = probe
            assert torch.equal(linear(x)[place], want), (rows, place)
            assert torch.equal(linear(x[None])[0, place], want), (rows, place, "3-d")
    assert linear.min_rows >= 1 and linear(probe[None]).shape == (1, n)


def test_queries_are_padded_to_whole_blocks_of_the_floor():
    """Every block of the kernel's split of the padded queries holds the floor at least, with the fewest
    added; a floor of 1 adds none."""
    for floor in (1, 2, 4, 16):
        for length in range(1, 1200):
            padded = padded_queries(length, floor)
            split = query_split(padded)
            last = padded % split or split
            assert padded >= length and padded >= floor and last >= floor, (length, floor)
            assert all(0 < m % query_split(m) < floor or m < floor for m in range(length, padded)), (length, floor)
            if floor == 1:
                assert padded == length
