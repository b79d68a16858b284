"""The batched sampler (engine/device/sampler.py) and the counter-based streams (engine/host/random_streams.py): the
processed distribution (`logprobs_mode`) is the one tokens are drawn from; a row's token does not depend
on the rows beside it; sampling frequencies from the streams' numbers agree with the distribution, which agrees
with a float64 reading of the API's description (tests/fake_backend.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fake_backend import filtered_scores as reference_scores
from logprobe.backend import SamplingParams
from logprobe.engine.device.sampler import BatchSettings, sample_batch, sample_row, sample_with_distribution
from logprobe.engine.host.random_streams import Stream

SETTINGS = [dict(temperature=0.6), dict(temperature=1.4, top_k=6), dict(temperature=1.0, top_p=0.7),
            dict(temperature=0.8, top_k=10, top_p=0.85)]


def row(vocab=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(vocab, generator=gen) * 2.0, dim=-1)


def batch(params: list[SamplingParams], rows: torch.Tensor, seeds: list[int]):
    return BatchSettings.of(params, rows.shape[-1], rows.device, seeds)


@pytest.mark.parametrize("settings", SETTINGS + [dict(temperature=0.0)])
def test_same_token_for_the_same_stream(settings):
    params = SamplingParams(**settings)
    lp = row()
    stream = Stream(5, 0)
    for step in range(30):
        u = stream.seed(step)
        token = sample_row(lp, params, u)
        again, dist = sample_with_distribution(lp[None], batch([params], lp[None], [u]))
        again, dist = int(again[0]), dist[0]
        assert token == again and torch.isfinite(dist[token])
        assert float(torch.logsumexp(dist, dim=0)) == pytest.approx(0.0, abs=1e-6)
    if params.is_greedy:
        assert float(dist[token]) == 0.0 and int(torch.isfinite(dist).sum()) == 1


@pytest.mark.parametrize("settings", SETTINGS)
def test_processed_distribution_matches_a_float64_reading_of_the_settings(settings):
    params = SamplingParams(**settings)
    lp = row(seed=2)
    _, dist = sample_with_distribution(lp[None], batch([params], lp[None], [5]))
    expected = reference_scores(lp.numpy(), params)
    expected = expected - np.logaddexp.reduce(expected[np.isfinite(expected)])
    assert np.array_equal(np.isfinite(expected), torch.isfinite(dist[0]).numpy())
    finite = np.isfinite(expected)
    assert np.allclose(dist[0].numpy()[finite], expected[finite], atol=2e-6)


def test_a_rows_token_does_not_depend_on_the_rows_beside_it():
    """Every setting (greedy too) in one batch of 64 rows draws what each row draws alone."""
    gen = torch.Generator().manual_seed(7)
    rows = torch.log_softmax(torch.randn(64, 300, generator=gen) * 3.0, dim=-1)
    options = SETTINGS + [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=1.0, top_k=1)]
    params = [SamplingParams(**options[i % len(options)]) for i in range(64)]
    uniforms = [Stream(i, i % 3).seed(i) for i in range(64)]
    s = batch(params, rows, uniforms)
    together = sample_batch(rows, s)
    _, together_dist = sample_with_distribution(rows, s)
    for i in range(64):
        alone = sample_row(rows[i], params[i], uniforms[i])
        assert int(together[i]) == alone
        alone_dist = sample_with_distribution(rows[i:i + 1], batch([params[i]], rows[i:i + 1], [uniforms[i]]))[1][0]
        assert torch.equal(alone_dist, together_dist[i])
    # and the batch's draws are not all the greedy choice (the test would not see a sampling bug)
    assert (together != rows.argmax(-1)).sum() > 10


@pytest.mark.parametrize("settings", SETTINGS)
def test_frequencies_agree_with_the_distribution(settings):
    """Drawn with one stream's consecutive numbers, as a choice draws its tokens."""
    params = SamplingParams(**settings)
    lp = row(seed=1)
    draws = 20_000
    stream = Stream(123, 0)
    uniforms = [stream.seed(step) for step in range(draws)]
    tokens, dist = sample_with_distribution(lp.expand(draws, -1).contiguous(),
                                            batch([params] * draws, lp.expand(draws, -1), uniforms))
    probs = dist[0].double().exp().numpy()
    counts = np.bincount(tokens.numpy(), minlength=len(probs))
    assert not counts[probs == 0].any()  # a token the filters leave out is never drawn
    bound = 5 * np.sqrt(probs * (1 - probs) / draws) + 1e-12
    assert np.all(np.abs(counts / draws - probs) <= bound), (counts / draws - probs)
    if "top_k" in settings:
        assert (probs > 0).sum() <= settings["top_k"]


def test_streams_are_fixed_by_seed_and_index():
    assert [Stream(9, 1).seed(i) for i in range(5)] == [Stream(9, 1).seed(i) for i in range(5)]
    firsts = {Stream(seed, index).seed(0) for seed in range(50) for index in range(4)}
    assert len(firsts) == 200  # no two (seed, index) pairs share a first seed
    assert Stream(None, 0).seed(0) != Stream(None, 0).seed(0)  # unseeded: a fresh key each time
    values = np.array([Stream(-3, 2).seed(i) for i in range(100_000)], dtype=np.uint64)
    # the 64 bits are balanced: each bit set in half of the seeds within 5 standard deviations
    bits = (values[:, None] >> np.arange(64, dtype=np.uint64)) & np.uint64(1)
    assert np.all(np.abs(bits.mean(axis=0) - 0.5) < 5 * np.sqrt(0.25 / len(values)))


def test_a_tiny_change_of_the_probabilities_keeps_the_token():
    """The draw compares each token's own ratio: moving every log probability by up to 1e-6 (what
    another batch shape's rounding does) keeps the token for all but a rare tie; an inverse-CDF draw
    in vocabulary order flips where the change below the token adds up."""
    gen = torch.Generator().manual_seed(11)
    rows = torch.log_softmax(torch.randn(400, 5000, generator=gen), dim=-1)  # flat: many likely tokens
    moved = rows + (torch.rand(rows.shape, generator=gen) - 0.5) * 2e-6
    params = [SamplingParams(temperature=1.0)] * len(rows)
    seeds = [Stream(1, 0).seed(i) for i in range(len(rows))]
    a = sample_batch(rows, batch(params, rows, seeds))
    b = sample_batch(moved, batch(params, moved, seeds))
    assert int((a != b).sum()) <= 1


def test_a_rows_random_numbers_are_splitmix64_from_its_seed():
    """The sampler's numbers in tensor operations are SplitMix64's outputs: the reference generator's
    published first outputs for seed 1234567, and a pure-Python SplitMix64 (random_streams._mix) for seeds
    over the whole 64-bit range (those of 2**63 and above are held as negative int64)."""
    from logprobe.engine.device.sampler import _signed, noise, splitmix64
    from logprobe.engine.host.random_streams import _GAMMA, _MASK, _mix

    first = splitmix64(torch.tensor([1234567]), 3)[0].numpy().view(np.uint64).tolist()
    assert first == [6457827717110365317, 3203168211198807973, 9817491932198370423]
    seeds = [0, 1, 2**63 - 1, 2**63, 2**64 - 1] + [Stream(7, i).seed(i) for i in range(5)]
    got = splitmix64(torch.tensor([_signed(s) for s in seeds]), 700).numpy().view(np.uint64)
    for row, seed in enumerate(seeds):
        assert got[row].tolist() == [_mix((seed + (i + 1) * _GAMMA) & _MASK) for i in range(700)]
    # the exponential numbers: v from the top 31 bits, -log(1 - v); v is rounded to float32, which moves
    # the large numbers (v near 1) by up to ~1e-5 of themselves and keeps the small ones exact
    e = noise(torch.tensor([_signed(s) for s in seeds]), 700).double().numpy()
    v = (got >> np.uint64(33)).astype(np.float64) * 2.0 ** -31 + 2.0 ** -32
    assert np.allclose(e, -np.log1p(-v), rtol=2e-5, atol=0)
    assert np.allclose(e[v < 0.5], -np.log1p(-v[v < 0.5]), rtol=3e-7, atol=0)
    many = noise(torch.tensor([_signed(Stream(3, 0).seed(i)) for i in range(64)]), 4096).double()
    assert abs(float(many.mean()) - 1.0) < 0.01 and abs(float(many.var()) - 1.0) < 0.03  # Exp(1)
    assert float(many.min()) > 0 and torch.isfinite(many).all()
