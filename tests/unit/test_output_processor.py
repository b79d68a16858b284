"""The engine's host side without a model: the sampler's host array cut into named `Pick`s
(engine/host/picks.py), and the output processor (engine/host/output_processor.py) recording them and applying
the stop rules. Both run in the engine and in its test double, and import no torch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from fake_backend import TinyTokenizer
from logprobe.backend import SamplingParams
from logprobe.engine.host.output_processor import OutputProcessor
from logprobe.engine.host.picks import Pick, split_picks
from logprobe.engine.host.request import SequenceGroup
from logprobe.tokens import TokenTable

TABLE = TokenTable.build(TinyTokenizer(), 258)


def test_split_picks_names_the_columns_of_the_host_array():
    k = 3  # the widest top-k of the batch; each group keeps its own
    rows = []
    for r in range(5):
        rows.append([10 + r, -0.5 - r] + [20 + r, 30 + r, 40 + r] + [-1.0 - r, -2.0 - r, -3.0 - r])
    host = np.asarray(rows, dtype=np.float64)
    first, second, third = split_picks(host, [2, 1, 2], [3, 0, 2], k)
    np.testing.assert_array_equal(first.tokens, [10, 11])
    assert first.tokens.dtype == np.int64 and first.logprobs.dtype == np.float32
    np.testing.assert_array_equal(first.logprobs, np.float32([-0.5, -1.5]))
    np.testing.assert_array_equal(first.top_ids, [[20, 30, 40], [21, 31, 41]])
    np.testing.assert_array_equal(first.top_logprobs, np.float32([[-1, -2, -3], [-2, -3, -4]]))
    assert second.top_ids.shape == (1, 0) and second.top_logprobs.shape == (1, 0) and second.tokens[0] == 12
    np.testing.assert_array_equal(third.top_ids, [[23, 33], [24, 34]])
    np.testing.assert_array_equal(third.top_logprobs, np.float32([[-4, -5], [-5, -6]]))


def pick(tokens, logprobs=None, top=None) -> Pick:
    n = len(tokens)
    top = np.zeros((n, 0)) if top is None else np.asarray(top)
    return Pick(np.asarray(tokens, np.int64), np.asarray(logprobs or [-1.0] * n, np.float32),
                top.astype(np.int64), -top.astype(np.float32))


def started(params: SamplingParams, prompt=(256, 65)) -> tuple[OutputProcessor, SequenceGroup]:
    outputs = OutputProcessor(context_length=64)
    group = SequenceGroup("r", list(prompt), params, TABLE)
    outputs.start_decoding(group)
    return outputs, group


def test_record_appends_each_row_to_its_sequence_and_drops_finished_rows():
    outputs, group = started(SamplingParams(max_tokens=5, n=3, logprobs=1, stop_token_ids=frozenset({257})))
    assert group.active_rows == [0, 1, 2]
    keep = outputs.record(group, pick([104, 257, 105], [-0.1, -0.2, -0.3], [[1], [2], [3]]))
    assert keep == [0, 2] and group.active_rows == [0, 2]
    assert group.sequences[1].finish_reason.value == "stop"
    keep = outputs.record(group, pick([106, 107], top=[[4], [5]]))  # rows are the active sequences 0 and 2
    assert keep == [0, 1]
    assert [s.token_ids for s in group.sequences] == [[104, 106], [257], [105, 107]]
    assert group.sequences[0].logprobs == [np.float32(-0.1), -1.0]
    ids, lps, top_ids, top_lps = group.sequences[2].columns(1)
    assert ids.tolist() == [105, 107] and top_ids.tolist() == [[3], [5]] and top_lps.tolist() == [[-3], [-5]]


def test_a_stop_string_cuts_the_text_and_the_tokens_from_it():
    outputs, group = started(SamplingParams(max_tokens=20, stop=["XY"]))
    seq = group.sequences[0]
    for token in b"ab X":
        assert outputs.record(group, pick([token])) == [0]
    assert outputs.record(group, pick([ord("Y")])) == []
    assert seq.finish_reason.value == "stop" and seq.text.text[:seq.text_end] == "ab "
    assert seq.num_kept_tokens == 3 and len(seq.token_ids) == 5
    assert group.output().choices[0].token_ids.tolist() == list(b"ab ")


def test_length_limits_end_a_sequence():
    outputs, group = started(SamplingParams(max_tokens=2))
    outputs.record(group, pick([97]))
    outputs.record(group, pick([98]))
    assert group.is_finished and group.sequences[0].finish_reason.value == "length"
    outputs, group = started(SamplingParams(max_tokens=100), prompt=list(range(60)))
    for token in b"abc":
        outputs.record(group, pick([token]))
    assert not group.is_finished
    outputs.record(group, pick([100]))  # 60 + 4 tokens fill the context of 64
    assert group.is_finished and group.sequences[0].finish_reason.value == "length"


def test_instrument_columns_and_processed_values_go_to_the_row_log():
    params = SamplingParams(max_tokens=1, logprobs=1, position_stats=True, logprobs_mode="both")
    outputs, group = started(params)
    p = pick([97], [-0.5], [[97]])
    p.processed_logprobs = np.float32([-0.25])
    p.processed_top_logprobs = np.float32([[-0.25]])
    p.columns = {"entropy": np.float32([1.5]), "ranks": np.int64([1])}
    outputs.record(group, p)
    (choice,) = group.output().choices
    assert choice.logprobs.tolist() == [-0.5] and choice.processed_logprobs.tolist() == [-0.25]
    assert choice.extras.entropy.tolist() == [1.5] and choice.extras.ranks.tolist() == [1]


def test_the_host_side_imports_no_torch():
    """Every module of the engine's host package (found by where it stands, not by a list) imports
    without torch or transformers; the package holds the scheduler, the request state and the output
    processor at least."""
    code = ("import importlib, pkgutil, sys\n"
            "import logprobe.engine.host as host\n"
            "names = sorted(m.name for m in pkgutil.iter_modules(host.__path__))\n"
            "for name in names: importlib.import_module('logprobe.engine.host.' + name)\n"
            "print(names)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    names, loaded = done.stdout.strip().splitlines()
    assert {"scheduler", "request", "output_processor", "picks", "tree", "streaming"} <= set(eval(names))
    assert loaded == "[]"
