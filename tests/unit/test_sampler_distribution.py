"""The processed distribution (`logprobs_mode`) is the one `sample_row` draws from: the same token for
the same random stream, and sampling frequencies that agree with it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from logprobe.backend import SamplingParams
from logprobe.engine.sampler import sample_row, sample_with_distribution

SETTINGS = [dict(temperature=0.6), dict(temperature=1.4, top_k=6), dict(temperature=1.0, top_p=0.7),
            dict(temperature=0.8, top_k=10, top_p=0.85)]


def row(vocab=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(vocab, generator=gen) * 2.0, dim=-1)


@pytest.mark.parametrize("settings", SETTINGS + [dict(temperature=0.0)])
def test_same_token_for_the_same_stream(settings):
    params = SamplingParams(**settings)
    lp = row()
    for seed in range(30):
        token = sample_row(lp, params, torch.Generator().manual_seed(seed))
        again, dist = sample_with_distribution(lp, params, torch.Generator().manual_seed(seed))
        assert token == again and torch.isfinite(dist[token])
        assert float(torch.logsumexp(dist, dim=0)) == pytest.approx(0.0, abs=1e-6)
    if params.is_greedy:
        assert float(dist[token]) == 0.0 and int(torch.isfinite(dist).sum()) == 1


@pytest.mark.parametrize("settings", SETTINGS)
def test_frequencies_agree_with_the_distribution(settings):
    params = SamplingParams(**settings)
    lp = row(seed=1)
    _, dist = sample_with_distribution(lp, params, torch.Generator().manual_seed(0))
    probs = dist.double().exp().numpy()
    gen = torch.Generator().manual_seed(123)
    draws = 20_000
    counts = np.bincount([sample_row(lp, params, gen) for _ in range(draws)], minlength=len(probs))
    assert not counts[probs == 0].any()  # a token the filters leave out is never drawn
    bound = 5 * np.sqrt(probs * (1 - probs) / draws) + 1e-12
    assert np.all(np.abs(counts / draws - probs) <= bound), (counts / draws - probs)
    if "top_k" in settings:
        assert (probs > 0).sum() <= settings["top_k"]
