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


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this build of torch")
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (3072, 576), (576, 576)])
def test_a_packed_bf16_products_one_row_call_gives_a_row_the_bits_of_a_call_of_two(shape):
    """SmolLM2's projections in bfloat16, pre-packed (`row_floors.packed_floor` measured their floor on
    other random weights): each of 256 rows has the same bits alone as in a call of 2, and where the
    floor pads a call of 1 row, the unpadded call does give some row other bits. (Calls of 2 and more:
    test_batch_invariance_bf16.py's probe.)"""
    n, k = shape
    gen = torch.Generator().manual_seed(n * 3 + k)
    linear = Linear((torch.randn(n, k, generator=gen) * 0.05).bfloat16(), None, pack=True)
    x = torch.randn(256, k, generator=gen).bfloat16()
    with torch.inference_mode():
        pairs = [linear(x[i:i + 2]) for i in range(0, 256, 2)]
        alone = [linear(x[i:i + 1])[0] for i in range(256)]
    same = all(torch.equal(alone[i], pairs[i // 2][i % 2]) for i in range(256))
    assert linear.min_rows in (1, 2)
    if linear.min_rows == 1:
        assert same
    else:  # padded: a 1-row call is a 2-row call, the same bits by construction
        assert same
        raw = torch.ops.mkldnn._linear_pointwise
        unpadded = [raw(x[i:i + 1], linear.packed, None, "none", [], "")[0] for i in range(256)]
        assert not all(torch.equal(unpadded[i], pairs[i // 2][i % 2]) for i in range(256))


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
