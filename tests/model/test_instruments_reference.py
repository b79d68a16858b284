"""The researcher's instruments on the engine, on both runners, against a float64 forward of the same
weights: asked ids' log probabilities and ranks at prompt and generated positions, entropy, top-p sets
and their mass, the actual token's rank, and the processed distribution (temperature, top-k, top-p,
greedy) that sampling draws from. Requests that ask for nothing get the answers they got before, in
the same batch as requests that ask, and before and after them."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from logprobe.engine.host.request import SamplingParams, SequenceGroup

TOL = 4e-5  # the sharper model's logits are ~5x the other tests': float32 rounding grows with them


def entropy_tol(row) -> float:
    """The entropy's tolerance where each log probability of `row` may be off by TOL: moving every log p by
    at most e moves -sum p log p by at most e (1 + H) to first order (the normalizer's shift counts once,
    each term's own error is weighted by its -log p). MKL's float32 kernels round differently on CPUs of
    different instruction sets (AVX2 against AVX-512), and the sum of a 49,152-token row shows it."""
    probs = np.exp(np.asarray(row, dtype=np.float64))
    return TOL * (1.0 - float((probs * row).sum()))
# (and with a log probability's size: the comparisons add a relative 1e-5, see assert_same_numbers)
PROMPT = "The quick brown fox jumps over"
# 20 ids: more than instruments.FEW_IDS (ranks by sorting), with the three tied tokens (conftest)
MANY_IDS = (100, 101, 102, 5, 330, 389, 2, 0, 17, 300, 4242, 49151, 7, 8, 9, 10, 11, 12, 13, 14)
FEW = (330, 389, 100, 101)


@pytest.fixture(scope="module")
def sharp_model(tokenizer, tiny_model_factory):
    """Weights of a larger scale than the other tests': distributions from near-certain to spread out
    (entropies 1 to 5 nats), so top-p sets have a few to a few dozen tokens."""
    return tiny_model_factory(len(tokenizer), seed=3, initializer_range=0.5)


@pytest.fixture(scope="module")
def sharp_reference(sharp_model, reference_of):
    return reference_of(sharp_model)


@pytest.fixture(scope="module")
def runner_model(sharp_model):
    """The model `engine` (tests/conftest.py) runs on both runners."""
    return sharp_model


def run(engine, *groups):
    asyncio.run(engine.run_groups(list(groups)))
    return [g.output() for g in groups]


def group(engine, prompt=PROMPT, **params):
    ids = engine.tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
    return SequenceGroup("t", ids, SamplingParams(**params), engine.table)


def check_ranks(reference, row, ids, ranks):
    for t, rank in zip(ids, ranks):
        lo, hi = reference.rank_bounds(row, t, tol=2 * TOL)
        assert lo <= rank <= hi, (t, rank, lo, hi)


def check_top_p(row, p, ids, values, count, mass, truncated, cap):
    """One top-p set against the float64 distribution `row`."""
    order = np.argsort(-row, kind="stable")
    probs = np.exp(row[order])
    total = np.cumsum(probs)
    assert 1 <= count <= cap
    ids = ids[:count]
    np.testing.assert_allclose(values[:count], row[ids], atol=TOL, rtol=1e-5)
    assert np.all(np.diff(row[ids]) <= TOL)  # the likeliest first
    # the set is the `count` likeliest (up to ties at its last value)
    assert np.all(row[ids] >= row[order[count - 1]] - TOL)
    assert mass == pytest.approx(total[count - 1], abs=TOL)
    # smallest: the mass before its last token is short of p; reaches p unless the cap cut it
    assert count == 1 or total[count - 2] < p + TOL
    if truncated:
        assert count == cap and total[cap - 1] < p + TOL
    else:
        assert total[count - 1] >= p - TOL


def reference_rows(reference, prompt_ids, token_ids):
    return reference.logprobs(list(prompt_ids) + list(token_ids)).numpy()


def test_prompt_positions(engine, sharp_reference):
    ids = engine.tokenizer(PROMPT).input_ids
    cap = 60
    out, = run(engine, group(engine, max_tokens=0, logprob_token_ids=MANY_IDS, position_stats=True,
                             top_logprobs_p=0.8, max_top_p_tokens=cap))
    cols = out.prompt_columns
    extras = cols.extras
    ref = reference_rows(sharp_reference, ids, [])
    assert np.isnan(extras.token_id_logprobs[0]).all() and np.isnan(extras.entropy[0])
    assert extras.top_p_ids.shape == (len(ids), cap)
    for pos in range(1, len(ids)):
        row = ref[pos - 1]
        np.testing.assert_allclose(extras.token_id_logprobs[pos], row[list(MANY_IDS)], atol=TOL, rtol=1e-5)
        check_ranks(sharp_reference, row, MANY_IDS, extras.token_id_ranks[pos])
        assert extras.token_id_ranks[pos][0] == extras.token_id_ranks[pos][1] == extras.token_id_ranks[pos][2]
        probs = np.exp(row)
        assert extras.entropy[pos] == pytest.approx(-(probs * row).sum(), abs=entropy_tol(row))
        check_ranks(sharp_reference, row, [ids[pos]], [cols.ranks[pos]])
        check_top_p(row, 0.8, extras.top_p_ids[pos], extras.top_p_logprobs[pos], extras.top_p_counts[pos],
                    extras.top_p_mass[pos], extras.top_p_truncated[pos], cap)
    assert extras.top_p_counts[1:].max() > 1  # the test sees sets of several tokens


def test_generated_positions(engine, sharp_reference):
    g = group(engine, max_tokens=6, n=2, seed=4, temperature=1.0, logprobs=2, logprob_token_ids=FEW,
              position_stats=True, top_logprobs_p=0.95, max_top_p_tokens=5)
    out, = run(engine, g)
    for choice in out.choices:
        ref = reference_rows(sharp_reference, g.prompt_ids, choice.token_ids)
        extras = choice.extras
        assert extras.token_id_logprobs.shape == (6, len(FEW)) and extras.entropy.shape == (6,)
        for i, token in enumerate(choice.token_ids):
            row = ref[len(g.prompt_ids) - 1 + i]
            np.testing.assert_allclose(extras.token_id_logprobs[i], row[list(FEW)], atol=TOL, rtol=1e-5)
            check_ranks(sharp_reference, row, FEW, extras.token_id_ranks[i])
            check_ranks(sharp_reference, row, [token], [extras.ranks[i]])
            assert extras.entropy[i] == pytest.approx(-(np.exp(row) * row).sum(), abs=entropy_tol(row))
            check_top_p(row, 0.95, extras.top_p_ids[i], extras.top_p_logprobs[i], extras.top_p_counts[i],
                        extras.top_p_mass[i], extras.top_p_truncated[i], 5)
            assert choice.logprobs[i] == pytest.approx(row[token], abs=TOL)  # raw, the default
        assert extras.top_p_truncated.any()  # cap 5 cuts some sets short of 0.95


def processed_reference(row: np.ndarray, params: SamplingParams, token: int) -> np.ndarray:
    """The sampling distribution in float64, written from the API's description, not from the sampler."""
    if params.is_greedy:
        out = np.full(row.shape, -np.inf)
        out[token] = 0.0
        return out
    scores = (row - row.max()) / params.temperature
    if 0 < params.top_k < len(row):
        kth = np.sort(scores)[::-1][params.top_k - 1]
        scores = np.where(scores < kth, -np.inf, scores)
    if params.top_p < 1:
        order = np.argsort(-scores, kind="stable")
        probs = np.exp(scores[order] - scores[order][0])
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        drop = before >= params.top_p
        drop[0] = False
        scores[order[drop]] = -np.inf
    finite = np.isfinite(scores)
    out = np.full(row.shape, -np.inf)
    out[finite] = scores[finite] - np.log(np.exp(scores[finite]).sum())
    return out


def assert_same_numbers(got, want, tol=TOL):
    """`got` (float32, from the engine) equals the float64 `want` within float32 rounding. Beside the
    absolute `tol`, a relative 1e-5: a processed log probability of -11.5 at temperature 0.7 carries 6e-5
    of rounding (5e-6 of its value), whatever the threads; the absolute bound alone held only for the
    summation order of two MKL threads."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want)
    assert np.array_equal(np.isneginf(got), np.isneginf(want)), (got, want)
    finite = ~np.isneginf(want)
    np.testing.assert_allclose(got[finite], want[finite], atol=tol, rtol=1e-5)


@pytest.mark.parametrize("sampling", [
    dict(temperature=0.7), dict(temperature=1.3, top_k=5), dict(temperature=0.9, top_p=0.6),
    dict(temperature=0.5, top_k=20, top_p=0.8), dict(temperature=0.0), dict(temperature=1.0, top_k=1),
])
def test_processed_log_probabilities(engine, sharp_reference, sampling):
    params = dict(max_tokens=5, n=3, seed=11, logprobs=4, logprob_token_ids=FEW, **sampling)
    raw, = run(engine, group(engine, **params))
    processed, = run(engine, group(engine, **params, logprobs_mode="processed"))
    both, = run(engine, group(engine, **params, logprobs_mode="both"))
    sp = SamplingParams(**params)
    # A processed log probability's error is the token's logit error less the processed distribution's
    # mean of the others', over the temperature. The raw value's mean, with the raw (spread) weights,
    # mostly cancels; the processed one's is near the top token's own, so two logits' rounding add: seen at
    # 8.5e-5 at T 0.7 on an AVX-512 Xeon (TOL / T is 5.7e-5), within it on an AVX2 EPYC.
    tol = 2 * TOL / min(1.0, max(sp.temperature, 1e-5))
    for r, p, b in zip(raw.choices, processed.choices, both.choices):
        # the mode changes the numbers, never the tokens (the same draws from the same distribution)
        assert np.array_equal(r.token_ids, p.token_ids) and np.array_equal(r.token_ids, b.token_ids)
        np.testing.assert_array_equal(b.logprobs, r.logprobs)
        np.testing.assert_array_equal(b.top_logprobs, r.top_logprobs)
        assert r.processed_logprobs is None and p.processed_logprobs is None
        ref = reference_rows(sharp_reference, raw_prompt(engine), r.token_ids)
        for i, token in enumerate(r.token_ids):
            row = ref[len(raw_prompt(engine)) - 1 + i]
            dist = processed_reference(row, sp, int(token))
            assert np.isfinite(dist[token])  # the sampled token is one the filters kept
            assert_same_numbers([p.logprobs[i]], [dist[token]], tol)
            assert_same_numbers([b.processed_logprobs[i]], [dist[token]], tol)
            assert_same_numbers(p.top_logprobs[i], dist[p.top_ids[i]], tol)
            assert_same_numbers(b.processed_top_logprobs[i], dist[b.top_ids[i]], tol)
            assert_same_numbers(p.extras.token_id_logprobs_processed[i], dist[list(FEW)], tol)
            np.testing.assert_allclose(p.extras.token_id_logprobs[i], row[list(FEW)], atol=TOL, rtol=1e-5)  # raw, any mode
        if sp.is_greedy:
            assert np.all(p.logprobs == 0.0)


def raw_prompt(engine):
    return engine.tokenizer(PROMPT).input_ids


PLAIN = [dict(max_tokens=6, n=2, seed=21, logprobs=3, temperature=0.8, top_p=0.9),
         dict(max_tokens=4, temperature=0, logprobs=1, echo=True),
         dict(max_tokens=0, echo=True, logprobs=2)]
ASKING = [dict(max_tokens=5, n=2, seed=5, logprobs=2, top_k=10, logprob_token_ids=MANY_IDS, position_stats=True,
               top_logprobs_p=0.5, logprobs_mode="both"),
          dict(max_tokens=0, echo=True, logprobs=0, position_stats=True, logprob_token_ids=FEW)]
INSTRUMENTS = ("logprob_token_ids", "position_stats", "top_logprobs_p", "logprobs_mode")


def answers(outs):
    """What a plain answer is made of, as bytes for a bit-for-bit comparison (nan equals nan)."""
    result = []
    for out in outs:
        pc = out.prompt_columns
        result.append((None if pc is None else (pc.logprobs.tobytes(), pc.ranks.tobytes(), pc.top_ids.tobytes(),
                                                pc.top_logprobs.tobytes(), pc.extras),
                       [(c.token_ids.tobytes(), c.logprobs.tobytes(), c.top_ids.tobytes(), c.top_logprobs.tobytes(),
                         c.text, c.extras, c.processed_logprobs) for c in out.choices]))
    return result


def test_plain_answers_unchanged_beside_and_around_instruments(engine):
    """Bit for bit: a batch's numbers depend on its shape (matrix kernels pick their blocking by the
    number of rows), so the plain requests are compared across batches of the same shape, whose other
    requests ask for every instrument or for none."""
    prompts = ["Once upon a time", "x", "A somewhat longer prompt for the batch"]

    def batch(others):
        return ([group(engine, p, **params) for p, params in zip(prompts, PLAIN)]
                + [group(engine, "Other text here", **params) for params in others])

    without = [{k: v for k, v in params.items() if k not in INSTRUMENTS} for params in ASKING]
    plain_batch = run(engine, *batch(without))
    before = answers(plain_batch)
    for result in before:
        assert result[0] is None or result[0][4] is None  # no extras for a plain request
        assert all(c[5] is None and c[6] is None for c in result[1])
    mixed = run(engine, *batch(ASKING))
    assert answers(mixed[:3]) == before[:3]
    # the asking requests' own tokens and raw numbers are those of their plain twins
    assert answers([mixed[3]])[0][1][0][:5] == before[3][1][0][:5]
    assert mixed[3].choices[0].extras is not None and mixed[4].prompt_columns.extras is not None
    np.testing.assert_array_equal(mixed[4].prompt_columns.logprobs, plain_batch[4].prompt_columns.logprobs)
    # a sequence: plain, asking, plain again
    alone = answers(run(engine, *[group(engine, p, **params) for p, params in zip(prompts, PLAIN)]))
    run(engine, *[group(engine, "Other text here", **params) for params in ASKING])
    again = answers(run(engine, *[group(engine, p, **params) for p, params in zip(prompts, PLAIN)]))
    assert again == alone


def test_plain_groups_have_no_instruments(engine):
    g = group(engine, **PLAIN[0])
    assert not g.has_instruments and not g.params.needs_position_columns
    run(engine, g)
    assert all(seq.rows is None for seq in g.sequences)


def test_over_http(client, reference, tiny_engine):
    """The blocks as the API writes them, from the session's engine, against its reference."""
    ids = tiny_engine.tokenizer("Answer: A or B").input_ids
    r = client.post("/v1/completions", json={
        "model": "tiny", "prompt": ids, "max_tokens": 2, "temperature": 0, "logprobs": 1,
        "logprob_token_ids": [330, 389], "position_stats": True, "top_logprobs_p": 0.001,
        "logprobs_mode": "both", "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    generated = [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
    ref = reference.logprobs(ids + generated).numpy()
    block, stats = choice["logprob_token_ids"], choice["position_stats"]
    for pos in range(1, len(ids) + len(generated)):
        row = ref[pos - 1]
        if pos < len(ids):
            values, section, i = block["prompt_logprobs"][pos], stats["prompt"], pos
        else:
            values, section, i = block["logprobs"][pos - len(ids)], stats["generated"], pos - len(ids)
        np.testing.assert_allclose(values, row[[330, 389]], atol=TOL, rtol=1e-5)
        assert section["entropy"][i] == pytest.approx(-(np.exp(row) * row).sum(), abs=entropy_tol(row))
        entry = section["top_p"][i]
        check_top_p(row, 0.001, np.array(entry["token_ids"]), np.array(entry["logprobs"]), len(entry["token_ids"]),
                    entry["mass"], entry["truncated"], 100)
    # greedy: the processed distribution is a point mass on the token
    assert choice["processed_logprobs"]["token_logprobs"] == [0.0, 0.0]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx([ref[len(ids) - 1 + i][t] for i, t in
                                                                  enumerate(generated)], abs=TOL)


def test_sampling_draws_from_the_processed_distribution(engine, sharp_reference):
    """Many seeded choices of one prompt: the first token's frequencies agree with the processed
    distribution the engine reports (within 5 standard errors), and no filtered token is drawn."""
    sampling = dict(temperature=0.8, top_k=8, top_p=0.9)
    out, = run(engine, group(engine, "Numbers:", max_tokens=1, n=16, seed=1, logprobs=8, logprobs_mode="processed",
                             **sampling))
    tokens = [int(c.token_ids[0]) for c in out.choices]
    for seed in range(2, 13):
        more, = run(engine, group(engine, "Numbers:", max_tokens=1, n=16, seed=seed, logprobs=0, **sampling))
        tokens += [int(c.token_ids[0]) for c in more.choices]
    first = out.choices[0]
    dist = dict(zip(first.top_ids[0].tolist(), np.exp(first.top_logprobs[0].astype(np.float64)).tolist()))
    assert sum(dist.values()) == pytest.approx(1.0, abs=1e-5)  # top-k 8 keeps at most these 8 tokens
    counts = np.bincount(tokens, minlength=engine.info.vocab_size)
    total = len(tokens)
    assert set(np.flatnonzero(counts)) <= {t for t, p in dist.items() if p > 0}
    for t, p in dist.items():
        assert abs(counts[t] / total - p) <= 5 * np.sqrt(p * (1 - p) / total) + 1e-9, (t, counts[t], p)
    torch.testing.assert_close(torch.tensor(sorted(dist.values())[-1]), torch.tensor(max(dist.values())))
