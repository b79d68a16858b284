"""`logprobe score --input` on the bundled model through the CLI: a mixed dataset in process and
through a server equals the float64 reference and itself; SIGKILL at three moments and a rerun give
every row once with the same numbers; bad input exits 2 with a message and no output; progress lines.

Slow: 300 rows scored by processes of their own on the bundled model, killed and resumed."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

from dataset_rows import mixed_rows, write_all  # noqa: E402
from logprobe import cli  # noqa: E402

pytestmark = pytest.mark.e2e
TOL = 2e-4
BOS = 1  # SmolLM2's declared BOS
COLUMNS = ["--column", "text", "--context-column", "context", "--id-column", "id"]
NUM_ROWS = 300  # the whole mix: ~20 s of scoring in process on the bundled model


def command(*args) -> list[str]:
    return [sys.executable, "-m", "logprobe.cli", "score", *args]


def run_cli(*args) -> subprocess.CompletedProcess:
    # The loaded 2-core machine may be slow; 900 s only stops a hung run
    return subprocess.run(command(*args), capture_output=True, text=True, timeout=900)


def run_in_process(*args) -> subprocess.CompletedProcess:
    """`logprobe score ARGS` through the CLI's own `main` in this process: the refusals need no process of
    their own (a process's exit status is `main`'s return value; test_a_refusal_exits_2_from_a_process
    checks that once through a real process)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli.main(["score", *args])
    return subprocess.CompletedProcess(command(*args), code, "", err.getvalue())


@pytest.fixture(scope="module")
def rows():
    return mixed_rows(NUM_ROWS, long_words=200)


@pytest.fixture(scope="module")
def files(rows, tmp_path_factory):
    return write_all(rows, tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def in_process(files, tmp_path_factory):
    """The JSON-lines file scored in process (progress to a pipe: plain lines): ({id: record}, stderr)."""
    out = tmp_path_factory.mktemp("out") / "scores.parquet"
    done = run_cli("--input", files["jsonl"], "--output", str(out), *COLUMNS, "--tokens", "--top", "2", "--stats")
    assert done.returncode == 0, done.stderr
    return {r["id"]: r for r in pq.read_table(out).to_pylist()}, done.stderr


def test_in_process_equals_float64_reference(in_process, rows, ref64, tokenizer):
    scores, _ = in_process
    assert list(scores) == [r["id"] for r in rows]
    checked = [r for i, r in enumerate(rows) if i % 12 == 0 or i in (5, 7, 14, 25, 36)]
    assert any(len(r["text"]) > 900 for r in checked) and any(r["context"] for r in checked)
    assert any(not r["text"] for r in checked) and any(not r["text"].isascii() for r in checked)
    for row in checked:
        got = scores[row["id"]]
        ids = tokenizer(row["text"], add_special_tokens=False).input_ids
        assert got["token_ids"] == ids and got["num_tokens"] == len(ids)
        if not ids:
            assert got["mean_logprob"] is None and got["logprob"] == 0
            continue
        head = [BOS] + (tokenizer(row["context"], add_special_tokens=False).input_ids if row["context"] else [])
        ref = ref64(head + ids)[len(head) - 1:-1]
        want = ref[np.arange(len(ids)), ids]
        np.testing.assert_allclose(got["token_logprobs"], want, atol=TOL, err_msg=row["id"])
        assert abs(got["logprob"] - want.sum()) < TOL * len(ids)
        np.testing.assert_allclose(got["entropy"], -(np.exp(ref) * ref).sum(-1), atol=TOL * 10, err_msg=row["id"])
        np.testing.assert_allclose(got["top_logprobs"], np.sort(ref, axis=-1)[:, ::-1][:, :2], atol=TOL)


def test_server_equals_in_process(in_process, files, server, tmp_path):
    scores, _ = in_process
    out = tmp_path / "remote.csv"
    done = run_cli("--input", files["csv"], "--output", str(out), *COLUMNS, "--tokens",
                   "--url", server, "--model", "smollm2-135m", "--concurrency", "3", "--quiet")
    assert done.returncode == 0, done.stderr
    import pyarrow.csv as pacsv

    remote = pacsv.read_csv(str(out), parse_options=pacsv.ParseOptions(newlines_in_values=True),
                            convert_options=pacsv.ConvertOptions(column_types={"id": pa.string()})).to_pylist()
    assert [r["id"] for r in remote] == list(scores)
    for got in remote:
        want = scores[got["id"]]
        assert got["num_tokens"] == want["num_tokens"]
        assert json.loads(got["tokens"]) == want["tokens"] and json.loads(got["token_ids"]) == want["token_ids"]
        if want["num_tokens"]:
            assert abs(got["logprob"] - want["logprob"]) < TOL * want["num_tokens"]
            np.testing.assert_allclose(json.loads(got["token_logprobs"]), want["token_logprobs"], atol=TOL)


def test_plain_progress_lines_off_a_terminal(in_process):
    _, stderr = in_process
    lines = [line for line in stderr.splitlines() if line.startswith("logprobe score:")]
    assert lines[0] == f"logprobe score: scoring {NUM_ROWS} rows"
    assert "rows/s" in lines[-2] and "tokens/s" in lines[-2] and f"{NUM_ROWS}/{NUM_ROWS} rows (100%)" in lines[-2]
    assert lines[-1].endswith(f"{NUM_ROWS} rows written to " + lines[-1].rsplit(" ", 1)[-1])
    assert "\r" not in stderr and "row/s" not in stderr  # no tqdm bar


def wait_for(proc, condition, what: str) -> None:
    """Poll until `condition()`; the job must still be running then."""
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the job ended before {what}: {proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.02)


def test_sigkill_at_any_moment_then_resume(in_process, files, tmp_path):
    scores, _ = in_process
    out = tmp_path / "out.parquet"
    parts = str(out) + ".parts"
    args = command("--input", files["parquet"], "--output", str(out), *COLUMNS, "--tokens", "--top", "2",
                   "--stats", "--chunk-rows", "5", "--quiet")

    def num_parts() -> int:
        try:
            return sum(n.startswith("part-") for n in os.listdir(parts))
        except FileNotFoundError:
            return -1

    for moment, condition in (("the parts directory appears", lambda: num_parts() >= 0),
                              ("3 parts", lambda: num_parts() >= 3),
                              ("6 parts", lambda: num_parts() >= 6)):
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            wait_for(proc, condition, moment)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        assert not out.exists()
        for name in os.listdir(parts):
            if name.startswith("part-"):
                pq.read_table(os.path.join(parts, name))  # whole, or it would not be there
    assert 6 <= num_parts() < 12
    done = run_cli(*args[4:])
    assert done.returncode == 0, done.stderr
    assert "logprobe score" not in done.stderr and "it/s" not in done.stderr  # --quiet
    assert not os.path.exists(parts)
    got = pq.read_table(out).to_pylist()
    assert [r["id"] for r in got] == list(scores)  # every row once, in input order
    for r in got:
        want = scores[r["id"]]
        assert r["token_ids"] == want["token_ids"] and r["num_tokens"] == want["num_tokens"]
        if r["num_tokens"]:
            assert abs(r["logprob"] - want["logprob"]) < TOL * r["num_tokens"]
            np.testing.assert_allclose(r["token_logprobs"], want["token_logprobs"], atol=TOL)


@pytest.mark.parametrize("name, content, flags, message", [
    ("missing.jsonl", '{"body": "a"}\n', [], "no column 'text' (--column); the columns are: 'body'"),
    ("cell.jsonl", '{"text": "a"}\n{"text": ["b"]}\n', [], "row 1 of column 'text' is list, not text"),
    ("broken.parquet", "not a parquet file", [], "cannot read"),
    ("ctx.csv", "text\na\n", ["--context-column", "ctx"], "no column 'ctx' (--context-column)"),
    ("long.txt", "fine\n" + "word " * 20000 + "\n", [], "row 1 (id '1') cannot be scored: This model's maximum "
                                                        "context length"),
], ids=["missing column", "non-text cell", "unreadable file", "missing context column", "past the context"])
def test_bad_input_exits_2_without_output(tmp_path, name, content, flags, message):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    out = tmp_path / "out.parquet"
    done = run_in_process("--input", str(path), "--output", str(out), *flags)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("logprobe score: ") and message in last
    assert not out.exists() and not os.path.exists(str(out) + ".parts")


@pytest.mark.parametrize("pattern", ["dir", "*.jsonl"])
def test_several_input_files_need_an_output(tmp_path, pattern):
    """A directory or glob names several files: the default output (the input's name + .scores.parquet)
    would be inside the directory or carry the glob's characters, so --output is asked for."""
    folder = tmp_path / "dir"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"text": "a"}\n', encoding="utf-8")
    given = str(folder) if pattern == "dir" else str(folder / pattern)
    done = run_in_process("--input", given, "--ray")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (f"logprobe score: {given} names several files: give --output "
                                                    "(a .parquet, .jsonl or .csv file)")
    assert sorted(os.listdir(folder)) == ["a.jsonl"]


def test_a_refusal_exits_2_from_a_process(tmp_path):
    """The refusals above run through the CLI's `main` in process; a real `logprobe score` process exits
    with its return value, 2, and writes nothing."""
    path = tmp_path / "missing.jsonl"
    path.write_text('{"body": "a"}\n', encoding="utf-8")
    out = tmp_path / "out.parquet"
    done = run_cli("--input", str(path), "--output", str(out))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (f"logprobe score: {path}: no column 'text' (--column); the "
                                                     "columns are: 'body'")
    assert not out.exists() and not os.path.exists(str(out) + ".parts")
