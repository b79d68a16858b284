"""The batch store under SIGKILL at every point of answering lines and finalizing: a process commits the
last lines of a batch, moves it to finalizing and finishes it, and kills itself with SIGKILL at the
k-th line the store executes, for every k; a fresh process then does what a restarted runner does
(runs the lines not done, finalizes). Every line must be in the output exactly once, the files as long
as the store says, the counts right. Also: leases, and a dead runner's leases freed on start.

Slow: the store is killed with SIGKILL at every step of answering and finalizing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import Counter

import orjson
import pytest

from logprobe.batch.store import Result, Store

N = 10
ERROR_LINE = 7  # this line's answer goes to the error file

CHILD = textwrap.dedent("""
    import os, signal, sys
    import orjson
    from logprobe.batch import store as store_module
    data_dir, kill_at = sys.argv[1], int(sys.argv[2])
    path = os.path.abspath(store_module.__file__)
    count = 0

    def tracer(frame, event, arg):
        global count
        if frame.f_code.co_filename != path:
            return None
        if event == "line":
            count += 1
            if count == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        return tracer

    store = store_module.Store(data_dir)
    batch_id = store.batches_in("in_progress")[0]["id"]
    results = [store_module.Result(batch_id, i, orjson.dumps({"custom_id": f"c{i}", "n": i}) + b"\\n", i == 7)
               for i in range(5, 10)]
    sys.settrace(tracer)
    store.commit(results)
    store.set_status(batch_id, "finalizing", ("in_progress",))
    store.finish(batch_id, "completed")
    sys.settrace(None)
    print(count)
""")


def answer(batch_id: str, idx: int) -> Result:
    return Result(batch_id, idx, orjson.dumps({"custom_id": f"c{idx}", "n": idx}) + b"\n", idx == ERROR_LINE)


def half_done_batch(data_dir) -> str:
    store = Store(data_dir)
    batch = store.add_batch("key-a", "/v1/score", "file-x", "m", None,
                            [(f"c{i}", b"{}", "", i) for i in range(N)], 86400)
    store.set_status(batch["id"], "in_progress", ("validating",))
    assert len(store.claim("runner-1", 5, 60)) == 5
    assert store.commit([answer(batch["id"], i) for i in range(5)]) == 5
    store.close()
    return batch["id"]


def run_child(data_dir, kill_at: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, str(data_dir), str(kill_at)], capture_output=True, text=True,
                          timeout=600)


def restart_and_finish(data_dir, batch_id: str) -> Store:
    """What a restarted runner does: run the lines not done, then finalize."""
    store = Store(data_dir)
    store.free_dead_leases(lambda owner: True)
    status = store.get_batch(None, batch_id)["status"]
    if status == "in_progress":
        pending = store.claim("runner-2", N, 60)
        store.commit([answer(batch_id, line.idx) for line in pending])
        store.set_status(batch_id, "finalizing", ("in_progress",))
    store.finish(batch_id, "completed")
    return store


def check_exactly_once(store: Store, batch_id: str) -> None:
    batch = store.get_batch("key-a", batch_id)
    assert batch["status"] == "completed" and (batch["completed"], batch["failed"]) == (N - 1, 1)
    seen = Counter()
    for column, want in (("output_file_id", N - 1), ("error_file_id", 1)):
        row = store.get_file("key-a", batch[column])
        data = store.path(batch[column]).read_bytes()
        assert row["bytes"] == len(data)
        lines = [orjson.loads(x) for x in data.splitlines()]
        assert len(lines) == want
        seen.update(x["custom_id"] for x in lines)
    assert seen == Counter(f"c{i}" for i in range(N))


def test_a_sigkill_anywhere_leaves_every_line_exactly_once(tmp_path):
    clean = tmp_path / "clean"
    batch_id = half_done_batch(clean)
    done = run_child(clean, 0)
    assert done.returncode == 0, done.stderr
    steps = int(done.stdout)
    check_exactly_once(Store(clean), batch_id)
    killed = 0
    for kill_at in range(1, steps + 1, max(1, steps // 60)):
        data_dir = tmp_path / f"k{kill_at}"
        batch_id = half_done_batch(data_dir)
        child = run_child(data_dir, kill_at)
        killed += child.returncode == -9
        check_exactly_once(restart_and_finish(data_dir, batch_id), batch_id)
    assert killed >= min(60, steps) * 0.9  # the kills did happen, at points spread over the whole work


def test_a_torn_tail_is_cut_before_the_next_answer(tmp_path):
    batch_id = half_done_batch(tmp_path)
    store = Store(tmp_path)
    out = store.path(store.get_batch(None, batch_id)["out_id"])
    committed = out.stat().st_size
    with open(out, "ab") as fh:
        fh.write(b'{"custom_id": "c5", "torn')  # what a writer killed before its commit left
    store.commit([answer(batch_id, 5)])
    assert out.read_bytes().count(b'"c5"') == 1 and out.stat().st_size > committed
    assert b"torn" not in out.read_bytes()


def test_leases(tmp_path):
    clock = [1000.0]
    store = Store(tmp_path, clock=lambda: clock[0])
    batch = store.add_batch("key-a", "/v1/score", "file-x", "m", None,
                            [(f"c{i}", b"{}", "ctx-b" if i % 2 else "ctx-a", 10 - i) for i in range(6)], 86400)
    assert store.claim("r1", 10, 30) == []  # validating: not yet
    store.set_status(batch["id"], "in_progress", ("validating",))
    first = store.claim("r1", 4, 30)
    # shared contexts together, shortest first within one: ctx-a (4, 2, 0 by length 6, 8, 10), then ctx-b
    assert [line.idx for line in first] == [4, 2, 0, 5]
    assert [line.idx for line in store.claim("r2", 10, 30)] == [3, 1]
    assert store.claim("r3", 10, 30) == []
    clock[0] += 20
    store.renew("r1", 30)
    clock[0] += 20  # r2's leases lapsed, r1's were renewed
    assert [line.idx for line in store.claim("r3", 10, 30)] == [3, 1]
    store.free_dead_leases(lambda owner: owner == "r1")
    assert [line.idx for line in store.claim("r4", 10, 30)] == [4, 2, 0, 5]
    # an answer committed twice (two runners ran the line) is written once
    assert store.commit([answer(batch["id"], 4), answer(batch["id"], 4)]) == 1
    assert store.commit([answer(batch["id"], 4)]) == 0
    assert store.get_batch("key-a", batch["id"])["completed"] == 1


@pytest.mark.parametrize("status", ["cancelled", "expired"])
def test_answers_after_the_end_are_dropped(tmp_path, status):
    batch_id = half_done_batch(tmp_path)
    store = Store(tmp_path)
    if status == "cancelled":
        store.set_status(batch_id, "cancelling", ("in_progress",))
        store.finish(batch_id, "cancelled")
    else:
        store.finish(batch_id, "expired", lambda custom_id: orjson.dumps({"custom_id": custom_id}) + b"\n")
    assert store.commit([answer(batch_id, 6)]) == 0
    batch = store.get_batch("key-a", batch_id)
    assert batch["status"] == status and batch["completed"] == 5
    assert batch["failed"] == (0 if status == "cancelled" else 5)
    assert os.path.getsize(store.path(batch["output_file_id"])) == batch["output_bytes"]
