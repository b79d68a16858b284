"""The plot and report of a scored dataset (src/logprobe/datasets/report.py) on small hand-made output
tables: which rows are the extremes, which tokens the most surprising, what the PNG holds."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest

from logprobe.datasets import report

PERPLEXITIES = [12.0, None, 3.5, 900.0, 3.5, 40.0]


def _table(with_tokens: bool) -> pa.Table:
    ids = ["a", "empty", "b", "c", "d", "e"]
    counts = [3, 0, 2, 4, 2, 1]
    columns = {
        "id": pa.array(ids, pa.string()),
        "num_tokens": pa.array(counts, pa.int64()),
        "logprob": pa.array([None if p is None else -math.log(p) * n for p, n in zip(PERPLEXITIES, counts)],
                            pa.float64()),
        "mean_logprob": pa.array([None if p is None else -math.log(p) for p in PERPLEXITIES], pa.float64()),
        "perplexity": pa.array(PERPLEXITIES, pa.float64()),
    }
    if with_tokens:
        columns["tokens"] = pa.array([["x", "y", "z"], [], ["p", "q"], ["r", "s", "t", "u"], ["v", "w"], ["!"]])
        columns["token_logprobs"] = pa.array([[-1.0, -4.0, -2.0], [], [-1.5, -1.0], [-9.0, -0.5, -7.0, -4.0],
                                              [-2.0, -0.1], [-3.0]], pa.list_(pa.float64()))
        columns["ranks"] = pa.array([[1, 20, 3], [], [2, 1], [500, 1, 90, 21], [4, 1], [7]], pa.list_(pa.int64()))
    return pa.table(columns)


def test_extreme_rows_order_and_skip_rows_without_perplexity():
    highest, lowest = report.extreme_rows(_table(False), count=2)
    assert [(i, p) for i, p, _ in highest] == [("c", 900.0), ("e", 40.0)]
    # a tie (b and d at 3.5) keeps the table's order; the empty row has no perplexity and is not shown
    assert [(i, p) for i, p, _ in lowest] == [("b", 3.5), ("d", 3.5)]
    assert all(i != "empty" for i, _, _ in highest + lowest)


def test_surprising_tokens_across_rows():
    found = report.surprising_tokens(_table(True), count=3)
    assert [(t["id"], t["position"], t["token"], t["logprob"], t["rank"]) for t in found] == [
        ("c", 0, "r", -9.0, 500), ("c", 2, "t", -7.0, 90), ("a", 1, "y", -4.0, 20)]


def test_surprising_tokens_need_token_columns():
    with pytest.raises(ValueError, match="--tokens"):
        report.surprising_tokens(_table(False))


def test_report_text():
    text = report.format_report(_table(True), texts={"c": "1 2 3 4 " * 20}, rows=1, tokens=2)
    lines = text.splitlines()
    assert lines[0] == "6 rows, 5 with a perplexity"
    high = lines.index("highest perplexity:")
    assert lines[high + 2].split()[:3] == ["900.0", "4", "c"] and lines[high + 2].endswith("...'")
    low = lines.index("lowest perplexity:")
    assert lines[low + 2].split() == ["3.5", "2", "b"]
    surprising = lines[lines.index("most surprising tokens:") + 2:]
    assert [line.split() for line in surprising] == [["-9.0000", "500", "0", "'r'", "c"],
                                                     ["-7.0000", "90", "2", "'t'", "c"]]


def test_report_without_tokens_says_what_they_need():
    text = report.format_report(_table(False))
    assert text.endswith("most surprising tokens:\n  (they need the per-token columns: score with --tokens)")


def test_report_counts_failed_rows():
    table = _table(False).append_column("error", pa.array([None, "too long", None, None, None, None]))
    first_line = report.format_report(table).splitlines()[0]
    assert first_line == "6 rows, 5 with a perplexity, 1 not scored (see the error column)"


def test_plot_is_a_png_of_the_rows_with_perplexity(tmp_path):
    path = tmp_path / "hist.png"
    assert report.plot_perplexity(_table(False), str(path)) == 5
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (800, 450)


def test_plot_of_one_value_and_of_none(tmp_path):
    one = pa.table({"id": ["a"], "num_tokens": pa.array([2], pa.int64()), "perplexity": pa.array([5.0])})
    assert report.plot_perplexity(one, str(tmp_path / "one.png")) == 1
    none = pa.table({"id": ["a"], "num_tokens": pa.array([0], pa.int64()),
                     "perplexity": pa.array([None], pa.float64())})
    with pytest.raises(ValueError, match="no row has a perplexity"):
        report.plot_perplexity(none, str(tmp_path / "none.png"))
    assert not (tmp_path / "none.png").exists()


@pytest.mark.parametrize("name", ["out.parquet", "out.jsonl", "out.csv"])
def test_read_output_gives_back_what_a_job_wrote(tmp_path, name):
    from logprobe.datasets.columns import ScoreOptions, schema
    from logprobe.datasets.job import write_table

    options = ScoreOptions(tokens=True)
    table = _table(True)
    table = pa.table({f.name: table.column(f.name) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
                      for f in schema(options)}, schema=schema(options))
    write_table(table, str(tmp_path / name), name.rsplit(".", 1)[1])
    back = report.read_output(str(tmp_path / name), options)
    assert back.equals(table)


def test_report_and_ray_flags():
    from logprobe.config import build_parser

    args = build_parser().parse_args(["score", "--input", "in.jsonl", "--report", "--plot", "h.png", "--ray",
                                      "--workers", "3", "--ray-address", "10.0.0.1:6379"])
    assert (args.report, args.plot, args.ray, args.workers, args.ray_address) == (True, "h.png", True, 3,
                                                                                  "10.0.0.1:6379")
    args = build_parser().parse_args(["score", "--input", "in.jsonl"])
    assert (args.report, args.ray, args.workers) == (False, False, 2)
