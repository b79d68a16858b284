"""The driver's side of the Ray job (src/logprobe/datasets/ray_job.py), without Ray: the blocks it hands
out, their results written as parts and merged (every row once), the refusal of a row a worker could not score, and the
CLI's dispatch to it. The pipeline itself runs in tests/e2e/test_dataset_ray.py."""

from __future__ import annotations

import pytest

pa = pytest.importorskip("pyarrow")

from logprobe.datasets import ray_job  # noqa: E402
from logprobe.datasets.io import DatasetError, Row  # noqa: E402


def _rows() -> list[Row]:
    texts = ["a much longer text than the others", "b", "", "mid length", "ctx row", "ctx row two, longer"]
    contexts = [None, None, None, None, "Q:", "Q:"]
    return [Row(i, f"id{i}", t, c) for i, (t, c) in enumerate(zip(texts, contexts))]


def test_blocks_hold_every_row_once_like_rows_together():
    blocks = ray_job.input_blocks(_rows(), batch_rows=4)
    assert [b.num_rows for b in blocks] == [4, 2]
    assert blocks[0].column_names == [ray_job.INDEX, "id", "text", "context"]
    order = [i for b in blocks for i in b.column(ray_job.INDEX).to_pylist()]
    # no context first, shortest first; then the rows of context "Q:", shortest first
    assert order == [2, 1, 3, 0, 4, 5]
    assert blocks[1].column("context").to_pylist() == ["Q:", "Q:"]
    assert blocks[0].column("context").null_count == 4


def _scored(indices: list[int], errors: list[str | None] | None = None):
    columns = {"id": [f"id{i}" for i in indices], "num_tokens": pa.array([1] * len(indices), pa.int64()),
               "error": pa.array(errors or [None] * len(indices), pa.string()),
               ray_job.INDEX: pa.array(indices, pa.int64())}
    return pa.table(columns)


def _merged(blocks: list, num_rows: int, tmp_path, skip_invalid: bool = False):
    """The blocks written as the driver writes them (ray_job._writer into job.Parts), then merged."""
    from logprobe.datasets.columns import ScoreOptions
    from logprobe.datasets.job import Parts

    parts = Parts(str(tmp_path / "out.parquet.parts"), {"test": True})
    parts.create()
    seen = []
    write = ray_job._writer(parts, ScoreOptions(skip_invalid=skip_invalid), _NoBar(), num_rows, 0,
                            lambda done, total: seen.append((done, total)))
    try:
        for block in blocks:
            write(block)
        return parts.merged(num_rows), seen
    finally:
        parts.release()


class _NoBar:
    def update(self, rows, tokens):
        pass


def test_results_back_in_input_order(tmp_path):
    table, seen = _merged([_scored([2, 0]), _scored([3, 1])], 4, tmp_path)
    assert table.column("id").to_pylist() == ["id0", "id1", "id2", "id3"]
    assert ray_job.INDEX not in table.column_names and "error" not in table.column_names
    assert seen == [(2, 4), (4, 4)]


def test_a_retried_block_counts_once(tmp_path):
    table, _ = _merged([_scored([0, 1]), _scored([1, 2]), _scored([0, 1])], 3, tmp_path, skip_invalid=True)
    assert table.column("id").to_pylist() == ["id0", "id1", "id2"] and "error" in table.column_names


@pytest.mark.parametrize("blocks", [[_scored([0, 2])], [_scored([0, 1, 2, 3])]],
                         ids=["a row missing", "a row too many"])
def test_a_row_missing_or_too_many_is_never_written(blocks, tmp_path):
    with pytest.raises(RuntimeError, match="of 3 rows"):
        _merged(blocks, 3, tmp_path)


def test_a_refused_row_names_the_first_one():
    ray_job.refuse_invalid(_scored([0, 1]))  # nothing refused: no error
    with pytest.raises(DatasetError, match=r"^row 3 \(id 'id3'\) cannot be scored: too long; --skip-invalid"):
        ray_job.refuse_invalid(_scored([5, 3, 4], [None, "too long", "also"]))


def test_bad_options_are_refused_before_ray_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(ray_job, "start_ray", lambda *a: pytest.fail("Ray started"))
    source = tmp_path / "in.txt"
    source.write_text("a\n", encoding="utf-8")
    with pytest.raises(DatasetError, match="--workers must be at least 1"):
        ray_job.run(str(source), str(tmp_path / "out.parquet"), workers=0)
    with pytest.raises(DatasetError, match="the output is .parquet, .jsonl or .csv"):
        ray_job.run(str(source), str(tmp_path / "out.txt"))
    with pytest.raises(DatasetError, match="no column 'text'"):
        bad = tmp_path / "in.jsonl"
        bad.write_text('{"body": "x"}\n', encoding="utf-8")
        ray_job.run(str(bad), str(tmp_path / "out.parquet"))


def test_the_cli_sends_ray_jobs_to_ray(tmp_path, monkeypatch, capsys):
    from logprobe import score_cli
    from logprobe.config import build_parser

    monkeypatch.delenv("LOGPROBE_RAY_ADDRESS", raising=False)
    calls = []
    monkeypatch.setattr(ray_job, "run", lambda *a, **kw: calls.append((a, kw)) or 7)
    source = tmp_path / "in.txt"
    source.write_text("a\n", encoding="utf-8")
    args = build_parser().parse_args(["score", "--input", str(source), "--output", str(tmp_path / "o.parquet"),
                                      "--ray", "--workers", "3", "--chunk-rows", "64", "--quiet"])
    assert score_cli.main(args) == 0
    (positional, keywords), = calls
    assert positional[:2] == (str(source), str(tmp_path / "o.parquet"))
    assert (keywords["workers"], keywords["batch_rows"], keywords["ray_address"], keywords["progress"]) == (
        3, 64, None, "none")

    args = build_parser().parse_args(["score", "--input", str(source), "--ray", "--url", "http://127.0.0.1:9"])
    assert score_cli.main(args) == 2
    assert "--ray scores on workers" in capsys.readouterr().err
