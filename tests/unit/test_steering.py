"""engine/device/steering.py on made-up rows: the masks of allowed_token_ids, bad words (one token: always;
several: only after the tokens before the last) and a grammar (complete and allowing only the end: the
stop tokens alone), the scores the sampler draws from, the allowed log mass (exactly 0 where nothing is
masked), `min_tokens` masking the stop tokens, a conflict named by its fields, and `steered_distributions`
against a float64 computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from logprobe.backend import Constraint, RequestConflict, SamplingParams
from logprobe.engine.device.steering import NoAllowedToken, Steering, allowed_logmass, steered_distributions

V = 12


def mask_of(*ids) -> np.ndarray:
    out = np.zeros(V, dtype=bool)
    out[list(ids)] = True
    return out


def steering(**params) -> Steering:
    return Steering(SamplingParams(**params), V, "cpu")


def test_unsteered_rows_mask_nothing():
    s = steering(logit_bias=((3, 2.0),))
    assert s.row_mask([1, 2, 3]) is None and s.masks([[1], [2]]) is None
    assert s.bias[3] == 2.0 and float(s.bias.abs().sum()) == 2.0


def test_allowed_token_ids_and_one_token_bad_words():
    s = steering(allowed_token_ids=(1, 2, 3, 3), bad_words_ids=((2,),))
    np.testing.assert_array_equal(s.row_mask([]), mask_of(1, 3))
    np.testing.assert_array_equal(s.row_mask([5, 6, 7]), mask_of(1, 3))


def test_bad_words_of_several_tokens_mask_their_last_after_the_rest():
    s = steering(bad_words_ids=((4, 5, 6), (7, 8)))
    assert s.row_mask([]) is None and s.row_mask([4]) is None and s.row_mask([5, 4]) is None
    np.testing.assert_array_equal(s.row_mask([1, 4, 5]), ~mask_of(6))
    np.testing.assert_array_equal(s.row_mask([7]), ~mask_of(8))
    np.testing.assert_array_equal(s.row_mask([4, 5, 7]), ~mask_of(8))  # only the newest prefix matters
    masks = s.masks([[0], [4, 5]])
    np.testing.assert_array_equal(masks, np.stack([np.ones(V, dtype=bool), ~mask_of(6)]))


def test_grammar_masks_and_the_end():
    s = steering(allowed_token_ids=(1, 2, 3, 11), stop_token_ids=frozenset({11}))
    np.testing.assert_array_equal(s.row_mask([], mask_of(2, 3, 9), False), mask_of(2, 3))
    # complete, and only the end (or nothing) allowed: the stop tokens alone
    np.testing.assert_array_equal(s.row_mask([], mask_of(11), True), mask_of(11))
    np.testing.assert_array_equal(s.row_mask([], mask_of(), True), mask_of(11))
    # complete but more may follow: unchanged
    np.testing.assert_array_equal(s.row_mask([], mask_of(2, 11), True), mask_of(2, 11))
    # a grammar mask narrower than the model's vocabulary (padding ids) is padded with False
    np.testing.assert_array_equal(s.row_mask([], mask_of(1, 2)[:5], False), mask_of(1, 2))


def test_no_allowed_token_is_the_requests_error():
    """A RequestConflict (the API's 400), naming the fields in force at that token as the body names them."""
    s = steering(allowed_token_ids=(1, 2), constraint=Constraint("regex", "x", param="response_format"))
    with pytest.raises(RequestConflict, match="^Invalid request: 'response_format' and 'allowed_token_ids' together "
                       "allow no token at generated token 2, so nothing") as caught:
        s.masks([[0]], [(mask_of(5), False)])
    assert isinstance(caught.value, NoAllowedToken) and caught.value.param == "response_format"
    with pytest.raises(RequestConflict, match="'allowed_token_ids' and 'bad_words' together allow no token at "
                       "generated token 1"):
        steering(allowed_token_ids=(1,), bad_words_ids=((1,),)).masks([[]])
    with pytest.raises(RequestConflict, match="'structured_outputs' allows no token at generated token 1"):
        steering(constraint=Constraint("regex", "x")).masks([[]], [(mask_of(), False)])


def test_min_tokens_masks_the_stop_tokens_until_then():
    s = steering(min_tokens=2, stop_token_ids=frozenset({3, 11}))
    np.testing.assert_array_equal(s.row_mask([7]), ~mask_of(3, 11))
    assert s.row_mask([7, 7]) is None  # from the third token on, nothing is masked
    # a complete grammar that allows only the end, before min_tokens: nothing left, named
    with pytest.raises(RequestConflict, match="'structured_outputs' and 'min_tokens' together allow no token at "
                       "generated token 2"):
        steering(min_tokens=2, stop_token_ids=frozenset({11}), constraint=Constraint("regex", "x")).masks(
            [[7]], [(mask_of(11), True)])


def test_scores_and_allowed_logmass():
    rows = torch.log_softmax(torch.randn(2, V, generator=torch.Generator().manual_seed(0)), dim=-1)
    s = steering(logit_bias=((0, -100.0), (4, 1.5)), allowed_token_ids=(0, 4, 5))
    masks = s.masks([[], []])
    scores = s.scores(rows, masks)
    assert torch.isneginf(scores[:, [1, 2, 3, 6]]).all()
    torch.testing.assert_close(scores[:, 4], rows[:, 4] + 1.5)
    torch.testing.assert_close(scores[:, 0], rows[:, 0] - 100.0)
    mass = allowed_logmass(rows, masks)
    want = np.log(np.exp(rows.double().numpy()[:, [0, 4, 5]]).sum(axis=1))
    np.testing.assert_allclose(mass.numpy(), want, atol=1e-6)
    everything = np.ones((2, V), dtype=bool)
    assert allowed_logmass(rows, everything).tolist() == [0.0, 0.0]  # exactly, not a rounded log of 1
    assert allowed_logmass(rows, None).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, -1, 1.0), (0.5, 2, 1.0), (1.3, -1, 0.7), (0.0, -1, 1.0)])
def test_steered_distributions_against_float64(temperature, top_k, top_p):
    rows = torch.log_softmax(torch.randn(3, V, generator=torch.Generator().manual_seed(1)) * 2, dim=-1)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, logit_bias=((2, 3.0), (7, -1.0)),
                            allowed_token_ids=(1, 2, 3, 7, 8, 9), bad_words_ids=((9,),))
    grammar = np.ones((3, V), dtype=bool)
    grammar[1, 2] = False  # a row-dependent mask on top of the request's own
    processed, mass = steered_distributions(rows, params, grammar)
    for r in range(3):
        allowed = mask_of(1, 2, 3, 7, 8) & grammar[r]
        scores = rows[r].double().numpy().copy()
        scores[2] += 3.0
        scores[7] -= 1.0
        scores[~allowed] = -np.inf
        if temperature == 0:
            want = np.where(np.arange(V) == np.argmax(scores), 0.0, -np.inf)
        else:
            scores = (scores - scores.max()) / temperature
            if top_k > 0:
                scores[scores < np.sort(scores)[::-1][top_k - 1]] = -np.inf
            if top_p < 1:
                order = np.argsort(-scores, kind="stable")
                probs = np.exp(scores[order]) / np.exp(scores[order]).sum()
                drop = np.cumsum(probs) - probs >= top_p
                drop[0] = False
                scores[order[drop]] = -np.inf
            want = scores - np.log(np.exp(scores[np.isfinite(scores)]).sum())
        got = processed[r].double().numpy()
        assert np.array_equal(np.isneginf(got), np.isneginf(want))
        np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], atol=2e-6)
        raw = rows[r].double().numpy()
        assert mass[r].item() == pytest.approx(np.log(np.exp(raw[allowed]).sum()), abs=2e-6)


def test_allowed_logmass_is_never_above_zero():
    """A mask that leaves out only tokens of negligible mass holds a mass of 1 less a hair; summed from
    float32 log probabilities that sum to a little more than 1, its log came out slightly positive
    (+8.6e-6 was seen). A log probability is at most 0, and so is this one."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 49152, generator=gen) * 3
    logits[:, 7] = -60.0  # left out: no mass to speak of
    rows = torch.log_softmax(logits, dim=-1)
    masks = np.ones(tuple(rows.shape), dtype=bool)
    masks[:, 7] = False
    unclamped = torch.logsumexp(rows.masked_fill(~torch.from_numpy(masks), float("-inf")), dim=-1)
    assert (unclamped > 0).any()  # the case exists in these rows
    mass = allowed_logmass(rows, masks)
    assert (mass <= 0).all()
    want = np.log(np.exp(rows.double().numpy()[:, masks[0]]).sum(axis=1))
    np.testing.assert_allclose(mass.numpy(), np.minimum(want, 0), atol=1e-5)


def test_scoring_under_a_constraint_gives_no_log_probability_above_zero():
    """/v1/score's `constraint` block sums a position's allowed mass in float64 from the engine's float32
    rows, which can sum to a little over 1: the allowed mass, and each token's log probability given
    the constraint, are at most 0, and the block's sums are the sums of what it reports."""
    from logprobe.api.score import constrained as constrained_scoring
    from logprobe.engine.host.grammar import TextCheck

    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(33, 49152, generator=gen) * 3
    logits[:, 7] = -60.0
    full = torch.log_softmax(logits, dim=-1).numpy()
    ids = np.argmax(full[1:], axis=-1)  # each position's likeliest token: its constrained log probability ~0
    masks = np.ones((len(ids), full.shape[1]), dtype=bool)
    masks[:, 7] = False
    raw = [float(np.logaddexp.reduce(full[1 + j].astype(np.float64)[masks[j]])) for j in range(len(ids))]
    assert max(raw) > 0  # the case exists in these rows
    out = constrained_scoring.block(TextCheck(masks, None, True), full, ids, first=1)
    assert max(out["constraint_logprobs"]) <= 0 and max(out["token_logprobs"]) <= 0
    np.testing.assert_allclose(out["constraint_logprobs"], np.minimum(raw, 0), atol=1e-12)
    assert out["constraint_logprob"] == sum(out["constraint_logprobs"])
    assert out["logprob"] == sum(out["token_logprobs"])
