"""count_greater (the rank's count of larger entries, bytes added in int64 lanes) equals the plain
count exactly, for every vocabulary shape it takes and the ones it hands to the plain sum."""

from __future__ import annotations

import pytest
import torch

from logprobe.engine.device.instruments import count_greater


@pytest.mark.parametrize("vocab", [8, 49_152, 128_256, 262_144, 32_064, 50_257, 13])
def test_count_greater_is_exact(vocab):
    gen = torch.Generator().manual_seed(vocab)
    rows = torch.log_softmax(torch.randn(6, vocab, generator=gen), dim=-1)
    rows[1, : vocab // 2] = float("-inf")  # many equal entries
    rows[2] = 0.0
    values = torch.stack([rows[0, 0], rows[1, 0], torch.tensor(-1.0), rows[3].max(), rows[4].min(),
                          torch.tensor(float("-inf"))])[:, None]
    want = (rows > values).sum(dim=-1)
    assert torch.equal(count_greater(rows, values), want)
    assert int(count_greater(rows, values)[2]) == vocab  # every 0.0 is above -1
    assert int(count_greater(rows, values)[3]) == 0  # nothing above the maximum
    # a block one column narrower (a width not a multiple of 8 takes the plain sum) agrees too
    if vocab > 8:
        part = rows[:, 1:]
        assert torch.equal(count_greater(part, values), (part > values).sum(dim=-1))
