"""The whole-vocabulary row encoder keeps its row skeletons within a count and a byte budget, and rows
encoded from several threads at once, with skeletons evicted under them, stay right."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import orjson

from logprobe.output import prompt_json
from logprobe.output.prompt_json import PromptLogprobsEncoder

VOCAB = 3000
NAMES = [f"t{i}\u00e9\"" if i % 7 else f"<{i}>" for i in range(VOCAB)]


def row(seed: int, decimals: int) -> tuple[np.ndarray, np.ndarray]:
    """Log probabilities that are multiples of 2^-decimals (exact in float32, so their shortest form, and
    with it the row's widest number, grows with `decimals`) and their ranks."""
    rng = np.random.default_rng(seed)
    lps = (-rng.integers(1, 1 << (decimals + 3), VOCAB) / 2.0 ** decimals).astype(np.float32)
    return lps, np.argsort(np.argsort(-lps, kind="stable"), kind="stable") + 1


def check(encoded: bytes, lps: np.ndarray, ranks: np.ndarray) -> None:
    assert encoded.startswith(b",{")
    parsed = orjson.loads(encoded[1:])
    assert list(parsed) == [str(i) for i in range(VOCAB)]
    got = np.array([parsed[str(i)]["logprob"] for i in range(VOCAB)], dtype=np.float32)
    assert np.array_equal(got, lps)
    assert [parsed[str(i)]["rank"] for i in range(VOCAB)] == ranks.tolist()
    assert parsed["7"]["decoded_token"] == "<7>" and parsed["8"]["decoded_token"] == "t8\u00e9\""


def test_skeletons_stay_within_their_byte_budget_and_rows_stay_right(monkeypatch):
    enc = PromptLogprobsEncoder(NAMES)
    lps, ranks = row(0, 1)
    check(enc.encode_vocab_row(lps, ranks), lps, ranks)
    one = enc.skeleton_bytes()
    assert one > VOCAB * 10  # the skeleton and its hole indexes
    # a budget of about two skeletons: rows of six different widths keep at most two cached
    monkeypatch.setattr(prompt_json, "SKELETON_BYTES", int(2.6 * one))
    for decimals in (1, 2, 3, 4, 5, 6, 2, 1):
        lps, ranks = row(decimals, decimals)
        check(enc.encode_vocab_row(lps, ranks), lps, ranks)
        assert len(enc._skeletons) <= 2 and enc.skeleton_bytes() <= prompt_json.SKELETON_BYTES
    # the most recently used stay: widths of decimals 2 and 1 (the last two rows)
    assert len(enc._skeletons) == 2
    # a budget below one skeleton still keeps the one in use
    monkeypatch.setattr(prompt_json, "SKELETON_BYTES", 1)
    lps, ranks = row(9, 3)
    check(enc.encode_vocab_row(lps, ranks), lps, ranks)
    assert len(enc._skeletons) == 1
    # and the count cap holds with an ample budget
    monkeypatch.setattr(prompt_json, "SKELETON_BYTES", 1 << 40)
    monkeypatch.setattr(prompt_json, "SKELETON_COUNT", 3)
    for decimals in range(1, 7):
        lps, ranks = row(decimals, decimals)
        check(enc.encode_vocab_row(lps, ranks), lps, ranks)
    assert len(enc._skeletons) == 3


def test_rows_encoded_on_threads_while_skeletons_are_evicted(monkeypatch):
    enc = PromptLogprobsEncoder(NAMES)
    lps, ranks = row(0, 1)
    enc.encode_vocab_row(lps, ranks)
    monkeypatch.setattr(prompt_json, "SKELETON_BYTES", int(1.5 * enc.skeleton_bytes()))
    rows = [row(i, 1 + i % 5) for i in range(40)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        encoded = list(pool.map(lambda r: enc.encode_vocab_row(*r), rows))
    for (lps, ranks), out in zip(rows, encoded):
        check(out, lps, ranks)
    assert len(enc._skeletons) == 1
