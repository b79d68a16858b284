"""`logprobe score --input ... --ray` (src/logprobe/datasets/ray_job.py) on a local Ray of two workers:
a mixed file scored as the in-process scorer scores it, a worker SIGKILLed mid-job without a row lost
or written twice, and a stopped job resumed by the same command. One Ray session (on 127.0.0.1) for the module.

The numbers are compared to float32 rounding, not bit for bit: a row's numbers may move in the last bits
with the rows that share its batch (docs/api.md, "Batching"), and the Ray job's batches are its blocks, the
in-process scorer's the engine's own.
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

pytestmark = pytest.mark.e2e

NUM_ROWS = 300
OPTIONS = ScoreOptions(tokens=True)
READ = ReadOptions(column="text", context_column="question", id_column="key")
WORKER_TITLE = "MapWorker(MapBatches(ScoreWorker))"  # the process title Ray gives the pool's actors
TOKEN_ATOL = 1e-4  # nats: float32 rounding under another batch is ~1e-5 (docs/api.md)

WORDS = ("the river bank was steep and the money in the bank was safe ; colourless green ideas sleep "
         "furiously , 1 2 3 4 5 , Paris is the capital of France . naïve café résumé 東京 🙂").split()


def _mixed_rows(rng: random.Random) -> list[dict]:
    """Lengths from empty to ~200 tokens, a shared context on some rows, numbers as ids."""
    rows = []
    for i in range(NUM_ROWS):
        length = rng.choice([0, 1, 2, 4, 8, 16, 32, 64]) if i % 37 else 0
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
    assert len(seen) == -(-NUM_ROWS // 40) and seen[-1] == (NUM_ROWS, NUM_ROWS)
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
    assert len(seen) == -(-(NUM_ROWS - first) // 50)  # only the rows the first run did not write
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
