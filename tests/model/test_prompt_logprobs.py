"""prompt_logprobs k and -1 (JSON and dense forms) against a float64 forward of the same weights."""

from __future__ import annotations

import base64

import numpy as np
import pytest

TOL = 1e-5


def post(client, **body):
    body.setdefault("model", "tiny")
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def check_position(entry, own: int, row: np.ndarray, k: int, reference, table, as_ids=False):
    """One prompt position's map against the reference distribution `row` (float64)."""
    assert str(own) in entry
    assert len(entry) in (k, k + 1) if k >= 0 else len(entry) == len(row)
    for key, item in entry.items():
        t = int(key)
        assert set(item) == {"logprob", "rank", "decoded_token"}
        assert abs(item["logprob"] - row[t]) < TOL, (t, item["logprob"], row[t])
        lo, hi = reference.rank_bounds(row, t)
        assert lo <= item["rank"] <= hi, (t, item["rank"], lo, hi)
        assert item["decoded_token"] == (f"token_id:{t}" if as_ids else table.strings[t])
    if k > 0:
        order = np.argsort(-row)
        kth = row[order[k - 1]]
        certain = {str(i) for i in order[:k] if row[i] > kth + TOL}
        assert certain <= set(entry)
        assert all(row[int(key)] >= kth - TOL for key in entry if key != str(own))


@pytest.mark.parametrize("k", [0, 1, 5, 100])
def test_prompt_logprobs_k(client, reference, tiny_engine, k):
    prompt = "The quick brown fox jumps over the lazy dog"
    out = post(client, prompt=prompt, max_tokens=1, prompt_logprobs=k)
    ids = tiny_engine.tokenizer(prompt).input_ids
    ref = reference.logprobs(ids).numpy()
    plp = out["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) == out["usage"]["prompt_tokens"]
    assert plp[0] is None
    for pos in range(1, len(ids)):
        check_position(plp[pos], ids[pos], ref[pos - 1], k, reference, tiny_engine.table)
    assert out["choices"][0]["logprobs"] is None


def test_prompt_logprobs_own_token_first_then_likeliest(client, tiny_engine):
    out = post(client, prompt=[5, 6, 7, 8], max_tokens=0, prompt_logprobs=3)
    for pos, entry in enumerate(out["choices"][0]["prompt_logprobs"][1:], start=1):
        keys = list(entry)
        assert keys[0] == str([5, 6, 7, 8][pos])
        values = [entry[key]["logprob"] for key in keys[1:]]
        assert values == sorted(values, reverse=True)


def test_ties_share_a_rank(client, reference, tiny_engine):
    # Tokens 100, 101, 102 always tie (conftest): ask for the whole vocabulary and check their ranks.
    ids = [100, 101, 102, 100, 7]
    out = post(client, prompt=ids, max_tokens=0, prompt_logprobs=-1)
    ref = reference.logprobs(ids).numpy()
    for pos in range(1, len(ids)):
        entry = out["choices"][0]["prompt_logprobs"][pos]
        ranks = {entry[str(t)]["rank"] for t in (100, 101, 102)}
        assert len(ranks) == 1
        assert ranks.pop() == int((ref[pos - 1] > ref[pos - 1][100]).sum()) + 1


def test_whole_vocabulary(client, reference, tiny_engine):
    prompt = "Every token, every position."
    out = post(client, prompt=prompt, max_tokens=1, prompt_logprobs=-1, n=2)
    ids = tiny_engine.tokenizer(prompt).input_ids
    ref = reference.logprobs(ids).numpy()
    vocab = tiny_engine.info.vocab_size
    for choice in out["choices"]:
        plp = choice["prompt_logprobs"]
        assert plp[0] is None and len(plp) == len(ids)
        for pos in range(1, len(ids)):
            entry = plp[pos]
            assert len(entry) == vocab and set(entry) == {str(i) for i in range(vocab)}
            lps = np.array([entry[str(i)]["logprob"] for i in range(vocab)])
            np.testing.assert_allclose(lps, ref[pos - 1], atol=TOL)
            ranks = np.array([entry[str(i)]["rank"] for i in range(vocab)])
            # Every rank lies within what the float64 reference allows (values within 1e-5 of each
            # other, each off by up to 1e-5, may fall either side), and is exact for the reported float32 values.
            neg_sorted = np.sort(-ref[pos - 1])
            lo = np.searchsorted(neg_sorted, -ref[pos - 1] - 2 * TOL, side="left") + 1
            hi = np.searchsorted(neg_sorted, -ref[pos - 1] + 2 * TOL, side="left") + 1
            assert np.all((lo <= ranks) & (ranks <= hi))
            f32 = lps.astype(np.float32)
            exact = np.searchsorted(np.sort(-f32), -f32, side="left") + 1
            assert np.array_equal(ranks, exact)
            assert entry[str(ids[pos])]["decoded_token"] == tiny_engine.table.strings[ids[pos]]


def test_dense_form_equals_json_bit_for_bit(client, tiny_engine):
    body = dict(prompt="Dense and sparse agree", max_tokens=0, prompt_logprobs=-1)
    sparse = post(client, **body)["choices"][0]["prompt_logprobs"]
    dense32 = post(client, **body, vocab_encoding="float32")["choices"][0]["prompt_logprobs"]
    dense16 = post(client, **body, vocab_encoding="float16")["choices"][0]["prompt_logprobs"]
    vocab = tiny_engine.info.vocab_size
    assert dense32[0] is None and len(dense32) == len(sparse)
    ids = tiny_engine.tokenizer(body["prompt"]).input_ids
    for pos in range(1, len(sparse)):
        d = dense32[pos]
        arr = np.frombuffer(base64.b64decode(d["logprobs"]), dtype="<f4")
        assert arr.shape == (vocab,)
        from_json = np.array([sparse[pos][str(i)]["logprob"] for i in range(vocab)], dtype=np.float32)
        assert np.array_equal(arr, from_json)
        assert d["token_id"] == ids[pos]
        assert d["logprob"] == sparse[pos][str(ids[pos])]["logprob"]
        assert d["rank"] == sparse[pos][str(ids[pos])]["rank"]
        half = np.frombuffer(base64.b64decode(dense16[pos]["logprobs"]), dtype="<f2")
        np.testing.assert_allclose(half.astype(np.float32), arr, rtol=1e-3, atol=1e-3)


def test_prompt_logprobs_with_echo_n_and_several_prompts(client, reference, tiny_engine):
    out = post(client, prompt=[[11, 12, 13], [14, 15]], max_tokens=2, n=2, echo=True, logprobs=1,
               prompt_logprobs=2, seed=5)
    assert len(out["choices"]) == 4
    for choice in out["choices"]:
        ids = [[11, 12, 13], [14, 15]][choice["index"] // 2]
        ref = reference.logprobs(ids).numpy()
        plp = choice["prompt_logprobs"]
        assert len(plp) == len(ids)
        for pos in range(1, len(ids)):
            check_position(plp[pos], ids[pos], ref[pos - 1], 2, reference, tiny_engine.table)
            # the echo logprobs and the prompt_logprobs give the same number for the prompt token
            assert choice["logprobs"]["token_logprobs"][pos] == plp[pos][str(ids[pos])]["logprob"]


def test_prompt_logprobs_token_ids_names(client, reference, tiny_engine):
    ids = [20, 21, 22]
    out = post(client, prompt=ids, max_tokens=0, prompt_logprobs=4, return_tokens_as_token_ids=True)
    ref = reference.logprobs(ids).numpy()
    for pos in (1, 2):
        check_position(out["choices"][0]["prompt_logprobs"][pos], ids[pos], ref[pos - 1], 4, reference,
                       tiny_engine.table, as_ids=True)


def test_single_token_prompt(client):
    out = post(client, prompt=[42], max_tokens=0, prompt_logprobs=5)
    assert out["choices"][0]["prompt_logprobs"] == [None]
    out = post(client, prompt=[42], max_tokens=0, prompt_logprobs=-1)
    assert out["choices"][0]["prompt_logprobs"] == [None]
