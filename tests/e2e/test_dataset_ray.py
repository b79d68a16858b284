"""`logprobe score --input ... --ray` (src/logprobe/datasets/ray_job.py) on a local Ray of two workers:
a mixed file scored as the in-process scorer scores it, a worker SIGKILLed mid-job without a row lost
or written twice, and a stopped job resumed by the same command. One Ray session (on 127.0.0.1) for the module.

Every number is compared bit for bit: a row's numbers do not depend on the rows that share its passes
(docs/api.md, "The same bits beside other requests"), though the Ray job's batches are its blocks, each
scored by a worker process of its own, and the in-process scorer's the engine's own (within 1e-4 nats on
torch older than 2.13, whose attention kernel lacks the property).

Slow: a local Ray cluster whose Ray Data workers each load the bundled model; jobs killed and resumed.
"""

from __future__ import annotations

import json
import os
import random
import signal

import pytest

pytest.importorskip("ray.data", reason="Ray Data is not installed (pip install 'logprobe[ray]')")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
psutil = pytest.importorskip("psutil")

from logprobe.datasets import ray_job  # noqa: E402
from logprobe.datasets.columns import ScoreOptions  # noqa: E402
from logprobe.datasets.io import read_rows  # noqa: E402
from logprobe.datasets.job import ReadOptions  # noqa: E402
from logprobe.engine.runners.lean.attention import Attention  # noqa: E402

pytestmark = pytest.mark.e2e

NUM_ROWS = 300
OPTIONS = ScoreOptions(tokens=True)
READ = ReadOptions(column="text", context_column="question", id_column="key")
WORKER_TITLE = "MapWorker(MapBatches(ScoreWorker))"  # the process title Ray gives the pool's actors
TOKEN_ATOL = 1e-4  # nats, on torch older than 2.13 only: float32 rounding under another batch is ~1e-5

WORDS = ("the river bank was steep and the money in the bank was safe ; colourless green ideas sleep "
         "furiously , 1 2 3 4 5 , Paris is the capital of France . naïve café résumé 東京 🙂").split()


def _mixed_rows(rng: random.Random) -> list[dict]:
    """Lengths from empty to ~60 tokens (mostly short: the rows' count, not their length, makes the chunks
    a job is cut into and killed or stopped between), a shared context on some rows, numbers as ids."""
    rows = []
    for i in range(NUM_ROWS):
        length = (rng.choice([0, 1, 2, 3, 5, 8]) if i % 60 != 29 else 40) if i % 37 else 0
        row = {"key": 1000 + i, "text": " ".join(rng.choice(WORDS) for _ in range(length))}
        if i % 4 == 0:
            row["question"] = "Answer in one line: what is on the river bank?"
        rows.append(row)
    return rows


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("ray-dataset") / "mixed.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        for row in _mixed_rows(random.Random(32)):
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def reference(dataset):
    """The in-process scorer's table for the file."""
    from logprobe.datasets.scorer import InProcessScorer

    scorer = InProcessScorer.from_model(options=OPTIONS)
    try:
        return scorer.score(read_rows(dataset, READ.column, READ.context_column, READ.id_column))
    finally:
        scorer.close()


@pytest.fixture(scope="module")
def local_ray():
    ray_job.start_ray(None, workers=2)
    import ray

    yield ray
    ray.shutdown()


def _assert_same_scores(got, want):
    assert got.schema.equals(want.schema)
    if Attention.invariant_kernels():  # torch >= 2.13: every row's every number the same bits
        for got_row, want_row in zip(got.to_pylist(), want.to_pylist(), strict=True):
            assert got_row == want_row, got_row["id"]
        return
    assert got.column("id").to_pylist() == want.column("id").to_pylist()
    for name in ("num_tokens", "tokens", "token_ids"):
        assert got.column(name).to_pylist() == want.column(name).to_pylist(), name
    for got_row, want_row in zip(got.to_pylist(), want.to_pylist()):
        for a, b in zip(got_row["token_logprobs"], want_row["token_logprobs"]):
            assert (a is None) == (b is None) and (a is None or abs(a - b) <= TOKEN_ATOL), got_row["id"]
        for name in ("logprob", "mean_logprob"):
            a, b = got_row[name], want_row[name]
            assert (a is None) == (b is None), (got_row["id"], name)
            assert a is None or abs(a - b) <= TOKEN_ATOL * max(1, got_row["num_tokens"]), (got_row["id"], name)
        assert (got_row["perplexity"] is None) == (want_row["perplexity"] is None)


def test_two_workers_score_as_in_process(local_ray, dataset, reference, tmp_path):
    out = tmp_path / "out.parquet"
    seen = []
    count = ray_job.run(dataset, str(out), OPTIONS, READ, workers=2, batch_rows=40, progress="none",
                        on_block=lambda done, total: seen.append((done, total)))
    assert count == NUM_ROWS
    table = pq.read_table(out)
    _assert_same_scores(table, reference)
    assert table.column("num_tokens").to_pylist().count(0) >= 9  # the empty rows came through
    # chunks of at most 40 rows (Ray Data's read blocks, cut into chunks, decide how many), each counted once
    done = [0] + [d for d, _ in seen]
    assert all(0 < b - a <= 40 for a, b in zip(done, done[1:])) and seen[-1] == (NUM_ROWS, NUM_ROWS)
    assert sorted(os.listdir(tmp_path)) == ["out.parquet"]  # no temporary file left


def _pool_processes() -> list:
    """The pool's actor processes: Ray's workers are started by this process's raylet, a child of it."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if WORKER_TITLE in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.NoSuchProcess:
            continue
    return found


def test_a_worker_killed_mid_job(local_ray, dataset, reference, tmp_path):
    out = tmp_path / "out.jsonl"
    killed = []

    def kill_one_worker(done, total):
        if killed:
            return
        workers = _pool_processes()
        assert workers, "no actor process of the pool found"
        workers[0].send_signal(signal.SIGKILL)
        killed.append((workers[0].pid, done, total))

    count = ray_job.run(dataset, str(out), OPTIONS, READ, workers=2, batch_rows=20, progress="none",
                        on_block=kill_one_worker)
    pid, done_then, total = killed[0]
    assert done_then < total  # killed with blocks still to score
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert count == NUM_ROWS
    with open(out, encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh]
    ids = [r["id"] for r in records]
    assert ids == [str(1000 + i) for i in range(NUM_ROWS)]  # every row once, in input order
    _assert_same_scores(pa.Table.from_pylist(records, schema=reference.schema), reference)


def test_the_same_command_again_resumes(local_ray, dataset, reference, tmp_path):
    """A job stopped after its first block (the driver gone) keeps that block in <output>.parts/; the
    same command again scores only the other rows, and the output holds every row once."""
    out = tmp_path / "out.parquet"

    class Stopped(Exception):
        pass

    def stop(done, total):
        raise Stopped(done)

    with pytest.raises(Stopped) as stopped:
        ray_job.run(dataset, str(out), OPTIONS, READ, workers=2, batch_rows=50, progress="none", on_block=stop)
    first = stopped.value.args[0]
    assert 0 < first < NUM_ROWS and not out.exists() and os.path.isdir(str(out) + ".parts")
    seen = []
    count = ray_job.run(dataset, str(out), OPTIONS, READ, workers=2, batch_rows=50, progress="none",
                        on_block=lambda done, total: seen.append(done))
    assert count == NUM_ROWS and seen[-1] == NUM_ROWS
    # the count starts from the rows the first run wrote and reaches every row: none of those scored again
    assert first < seen[0] <= first + 50
    _assert_same_scores(pq.read_table(out), reference)
    assert sorted(os.listdir(tmp_path)) == ["out.parquet"]


def test_a_refused_row_ends_the_job_with_its_message(local_ray, tmp_path):
    path = tmp_path / "long.txt"
    path.write_text("short\n" + "word " * 10_000 + "\n", encoding="utf-8")
    out = tmp_path / "out.parquet"
    from logprobe.datasets.io import DatasetError

    with pytest.raises(DatasetError, match=r"row 1 \(id '1'\) cannot be scored"):
        ray_job.run(str(path), str(out), ScoreOptions(), workers=1, progress="none")
    assert not out.exists()


def _split_into_files(rows: list[dict], directory, fmt: str, sizes=(70, 130, 100)) -> None:
    """The rows in len(sizes) files of `directory`, whose names sort in row order."""
    directory.mkdir()
    schema = pa.schema([("key", pa.int64()), ("text", pa.string()), ("question", pa.string())])
    at = 0
    for number, size in enumerate(sizes):
        chunk = rows[at:at + size]
        at += size
        if fmt == "parquet":
            pq.write_table(pa.Table.from_pylist(chunk, schema=schema), directory / f"part-{number}.parquet")
        else:
            with open(directory / f"part-{number}.jsonl", "w", encoding="utf-8") as fh:
                fh.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in chunk)
    assert at == len(rows)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_directory_of_files(local_ray, reference, tmp_path, fmt):
    """Several files of one directory (a glob for JSONL) are one dataset: rows numbered across the files in
    path order, scored on two workers as in process; a Parquet job stopped after its first chunk resumes."""
    _split_into_files(_mixed_rows(random.Random(32)), tmp_path / "in", fmt)
    source = str(tmp_path / "in") if fmt == "parquet" else str(tmp_path / "in" / "*.jsonl")
    out = tmp_path / "out.parquet"

    class Stopped(Exception):
        pass

    def stop(done, total):
        raise Stopped(done)

    first = 0
    if fmt == "parquet":
        with pytest.raises(Stopped) as stopped:
            ray_job.run(source, str(out), OPTIONS, READ, workers=2, batch_rows=40, progress="none", on_block=stop)
        first = stopped.value.args[0]
        assert 0 < first < NUM_ROWS and not out.exists()
    seen = []
    count = ray_job.run(source, str(out), OPTIONS, READ, workers=2, batch_rows=40, progress="none",
                        on_block=lambda done, total: seen.append(done))
    # the second run starts from the first one's rows and scores the others, each once
    assert count == NUM_ROWS and first < seen[0] <= first + 40 and seen[-1] == NUM_ROWS
    table = pq.read_table(out)
    assert table.column("id").to_pylist() == [str(1000 + i) for i in range(NUM_ROWS)]
    _assert_same_scores(table, reference)
    assert sorted(os.listdir(tmp_path)) == ["in", "out.parquet"]


def _rows_as_read_on_ray(path: str, read: ReadOptions) -> list[tuple]:
    """(index, id, text, context) of every row as the Ray job reads and checks it, in index order."""
    import ray

    from logprobe.datasets import ray_input

    files, kind = ray_input.input_files(path)
    chunks, num_rows = ray_input.prepare(path, files, kind, read, set(), chunk_rows=7)
    tables = ray.get(chunks)
    rows = sorted(row for t in tables for row in zip(*(t.column(n).to_pylist()
                                                        for n in (ray_job.INDEX, "id", "text", "context"))))
    assert len(rows) == num_rows
    return rows


def test_rows_and_ids_as_in_process(local_ray, tmp_path):
    """Line breaks other than \\n in a .txt file, and "007" ids, an empty context and a newline in a CSV
    cell: the same rows, indices and ids as io.read_rows gives."""
    text = tmp_path / "odd.txt"
    text.write_bytes("one\r\ntwo\u2028still two\x0cand\rstill\n\nlast 🙂".encode("utf-8"))
    csv_path = tmp_path / "ids.csv"
    csv_path.write_text('key,text,question\n007,"a\nb",\n8,plain,why?\n', encoding="utf-8")
    cases = [(str(text), ReadOptions()), (str(csv_path), READ)]
    for path, read in cases:
        want = [(r.index, r.id, r.text, r.context) for r in read_rows(path, read.column, read.context_column,
                                                                      read.id_column)]
        assert _rows_as_read_on_ray(path, read) == want, path
    assert [r[2] for r in _rows_as_read_on_ray(str(text), ReadOptions())][1] == "two\u2028still two\x0cand\rstill"


def _bad_inputs(tmp_path) -> list[tuple[str, ReadOptions]]:
    """Inputs the in-process job refuses, each as one file (row numbers as in process)."""
    good = [{"key": i, "text": f"row {i}", "question": None} for i in range(40)]
    schema = pa.schema([("key", pa.int64()), ("text", pa.string()), ("question", pa.string())])
    null_text = [dict(r, text=None) if r["key"] == 33 else r for r in good]
    repeated_id = [dict(r, key=5) if r["key"] == 31 else r for r in good]
    cases = []
    for name, rows in (("null_text", null_text), ("repeated_id", repeated_id)):
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
        cases.append((str(path), READ))
    cases.append((cases[0][0], ReadOptions(column="body")))  # no such column
    cases.append((cases[0][0], ReadOptions(id_column="text")))  # a null id
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not a parquet file")
    cases.append((str(broken), ReadOptions()))
    return cases


def test_bad_input_is_refused_as_in_process(local_ray, tmp_path):
    from logprobe.datasets.io import DatasetError

    out = tmp_path / "out.parquet"
    for path, read in _bad_inputs(tmp_path):
        with pytest.raises(DatasetError) as in_process:
            read_rows(path, read.column, read.context_column, read.id_column)
        with pytest.raises(DatasetError) as on_ray:
            ray_job.run(path, str(out), OPTIONS, read, workers=2, progress="none")
        if "broken" in path:  # pyarrow's own words differ between its readers; the file is named
            assert on_ray.value.message.startswith(f"cannot read {path}: "), on_ray.value.message
        else:
            assert on_ray.value.message == in_process.value.message
        assert not out.exists() and not os.path.exists(str(out) + ".parts")


def test_a_bad_cell_in_a_later_file_is_named_by_its_input_row(local_ray, tmp_path):
    from logprobe.datasets.io import DatasetError

    rows = [{"key": i, "text": f"row {i}", "question": None} for i in range(NUM_ROWS)]
    rows[250]["text"] = None
    _split_into_files(rows, tmp_path / "in", "parquet")
    with pytest.raises(DatasetError, match=r"in: row 250 of column 'text' is null, not text"):
        ray_job.run(str(tmp_path / "in"), str(tmp_path / "out.parquet"), OPTIONS, READ, workers=2, progress="none")
    assert sorted(os.listdir(tmp_path)) == ["in"]
