"""The driver's side of the Ray job (src/logprobe/datasets/ray_job.py, ray_input.py), without Ray: the chunks
a read block becomes, their results written as parts and merged (every row once), the refusal of a row a
worker could not score, and the CLI's dispatch to it. The pipeline itself runs in tests/e2e/test_dataset_ray.py."""

from __future__ import annotations

import pytest

pa = pytest.importorskip("pyarrow")

from logprobe.datasets import ray_job  # noqa: E402
from logprobe.datasets.io import DatasetError  # noqa: E402


def _block():
    texts = ["a much longer text than the others", "b", "", "mid length", "ctx row", "ctx row two, longer"]
    contexts = [None, None, "", None, "Q:", "Q:"]
    return pa.table({"key": [f"id{i}" for i in range(6)], "body": texts, "q": contexts})


NAMES = {"text": "body", "context": "q", "id": "key"}


def test_a_block_becomes_chunks_of_like_rows_without_the_rows_done():
    """Rows 10..15 of the input; row 11 already in the parts; chunks of 3 and 2 rows, one id bucket."""
    pytest.importorskip("ray.data")
    from logprobe.datasets import ray_input

    ranges = ray_input.ranges_of({3, 4, 11, 30})
    assert ranges == [(3, 5), (11, 12), (30, 31)]
    held, touching = ray_input.overlap(ranges, 10, 16)
    assert (held, touching) == (1, [(11, 12)])
    problem, *chunks, ids = ray_input.index_block(_block(), 10, touching, NAMES, "in.parquet", [3, 2], buckets=1)
    assert problem is None and [c.num_rows for c in chunks] == [3, 2]
    assert chunks[0].column_names == [ray_input.INDEX, "id", "text", "context"]
    order = [i for c in chunks for i in c.column(ray_input.INDEX).to_pylist()]
    # no context first (an empty one is none), shortest first; then the rows of context "Q:", shortest first
    assert order == [12, 13, 10, 14, 15]
    assert chunks[1].column("context").to_pylist() == ["Q:", "Q:"] and chunks[0].column("context").null_count == 3
    assert ids.column("id").to_pylist() == [f"id{i}" for i in range(6)]  # every row, the done one too
    assert ray_input.first_duplicate(ids) is None
    one = pa.table({"id": ["x", "y"], ray_input.INDEX: pa.array([7, 2], pa.int64())})
    two = pa.table({"id": ["y", "x", "z"], ray_input.INDEX: pa.array([5, 3, 4], pa.int64())})
    assert ray_input.first_duplicate(one, None, two) == (5, 2, "y")  # "y" is seen again first, in row 5


def test_a_block_reports_its_first_problem_by_input_row():
    pytest.importorskip("ray.data")
    from logprobe.datasets import ray_input

    table = _block().set_column(1, "body", pa.array(["x", None, "y", "z", 5 * "w", "v"]))
    problem = ray_input.index_block(table, 100, [], NAMES, "in.parquet", [6], buckets=0)[0]
    assert problem == (1, 101, "in.parquet: row 101 of column 'body' is null, not text")
    problem = ray_input.index_block(table, 0, [], dict(NAMES, id="nope"), "in.parquet", [6], buckets=0)[0]
    assert problem[2] == "in.parquet: no column 'nope' (--id-column); the columns are: 'key', 'body', 'q'"
    problem = ray_input.index_block(pa.table({}), 0, [], NAMES, "in.jsonl", [], buckets=0)[0]
    assert problem[2] == "in.jsonl: the file is empty: there are no rows to score"  # as the in-process job


def test_input_files_of_a_directory_and_a_glob(tmp_path):
    from logprobe.datasets import ray_input

    for name in ("b.parquet", "a.parquet", "_SUCCESS", ".a.parquet.crc"):
        (tmp_path / name).write_bytes(b"")
    assert ray_input.input_files(str(tmp_path)) == ([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")],
                                                    "parquet")
    assert ray_input.input_files(str(tmp_path / "b*"))[0] == [str(tmp_path / "b.parquet")]
    (tmp_path / "c.csv").write_bytes(b"")
    with pytest.raises(DatasetError, match="of one type"):
        ray_input.input_files(str(tmp_path))
    with pytest.raises(DatasetError, match="No such file or directory"):
        ray_input.input_files(str(tmp_path / "missing.parquet"))


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
    with pytest.raises(DatasetError, match="missing.jsonl: No such file or directory"):
        ray_job.run(str(tmp_path / "missing.jsonl"), str(tmp_path / "out.parquet"))
    with pytest.raises(DatasetError, match="a .txt file is one text a line"):  # cells are checked on Ray
        ray_job.run(str(source), str(tmp_path / "out.parquet"), read_opts=ray_job.ReadOptions(id_column="id"))


def test_the_cli_sends_ray_jobs_to_ray(tmp_path, monkeypatch, capsys):
    """The CLI's arguments reach ray_job.run (replaced here). The CLI refuses --ray without Ray Data before
    that (tests/unit/test_install_hints.py), so this runs where Ray is installed (the highest end)."""
    pytest.importorskip("ray.data")
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
