"""A batch behind `--replicas 2` with one replica killed (SIGKILL) mid-batch: the runner in the ingress
runs the lost lines again on the other replica (and Serve's replacement), the batch completes, and the
output has every line exactly once, each the answer its body gets alone.

Slow: a Ray cluster of two replicas, 32 generations, a replica killed and replaced."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest

from batch_helpers import assert_same_answer, jsonl, request_line, without_ids
from logprobe.engine.runners.lean.attention import Attention

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'logprobe[ray]')")
pytestmark = pytest.mark.e2e
# a line's answer and its body's alone: the same bits where the attention kernel allows (torch >= 2.13)
SAME = 0.0 if Attention.invariant_kernels() else 1e-4

_spec = importlib.util.spec_from_file_location("logprobe_servers", Path(__file__).parents[2] / "benchmarks" / "servers.py")
servers = sys.modules.get("logprobe_servers") or importlib.util.module_from_spec(_spec)
if "logprobe_servers" not in sys.modules:
    sys.modules["logprobe_servers"] = servers
    _spec.loader.exec_module(servers)

MODEL = "smollm2-135m"
LINES = 32


def busy_replicas(client: httpx.Client) -> set[str]:
    """The replicas whose engine holds sequence groups, by their latest report (one a second)."""
    busy = set()
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("logprobe_engine_sequence_groups{") and float(line.rsplit(" ", 1)[1]) > 0:
            busy.add(re.search(r'replica="([^"]+)"', line).group(1))
    return busy


def test_a_replica_lost_mid_batch(tmp_path):
    # At most 8 lines on a replica at once (Serve keeps the others waiting for room): the 32 lines are on
    # both replicas, whatever Serve's router makes of a burst (it sent all of them to one on a loaded machine).
    cluster = servers.start(["--replicas", "2", "--cpus-per-replica", "1", "--ray-cpus", "2",
                             "--max-ongoing-per-replica", "8", "--data-dir", str(tmp_path)],
                            prefix="logprobe-batch-replicas-")
    try:
        lines = [request_line(f"g{i}", "/v1/completions", {"model": MODEL, "prompt": f"Count to {i}:",
                                                            "max_tokens": 24, "temperature": 0, "logprobs": 1})
                 for i in range(LINES)]
        with httpx.Client(base_url=cluster.base, timeout=600) as client:
            uploaded = client.post("/v1/files", data={"purpose": "batch"},
                                   files={"file": ("lines.jsonl", jsonl(lines))}).json()
            batch_id = client.post("/v1/batches", json={"input_file_id": uploaded["id"],
                                                        "endpoint": "/v1/completions",
                                                        "completion_window": "24h"}).json()["id"]
            victims = set(cluster.session_pids_running(b"ModelReplica"))
            assert len(victims) == 2
            deadline = time.monotonic() + 600
            # Lines are on both replicas, however long that takes. /metrics leaves out a replica whose
            # last report (one a second) is over 5 s old, as a busy replica's may be on a loaded machine:
            # a replica counts as busy for 5 s after it was last seen so.
            seen: dict[str, float] = {}
            while True:
                now = time.monotonic()
                seen.update((replica, now) for replica in busy_replicas(client))
                if sum(now - at < 5 for at in seen.values()) >= 2:
                    break
                batch = client.get(f"/v1/batches/{batch_id}").json()
                assert batch["status"] not in ("completed", "failed"), ("the batch ended before both replicas "
                                                                        "were seen busy", seen, batch)
                assert now < deadline, (seen, batch)
                time.sleep(0.05)
            os.kill(min(victims), signal.SIGKILL)
            at_kill = client.get(f"/v1/batches/{batch_id}").json()["request_counts"]["completed"]
            while (batch := client.get(f"/v1/batches/{batch_id}").json())["status"] != "completed":
                assert time.monotonic() < deadline, batch
                time.sleep(0.2)
            assert batch["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
            raw = client.get(f"/v1/files/{batch['output_file_id']}/content").content
            output = {}
            for entry in map(orjson.loads, raw.splitlines()):
                assert entry["custom_id"] not in output
                output[entry["custom_id"]] = entry["response"]
            assert sorted(output) == sorted(x["custom_id"] for x in lines)
            if at_kill < LINES:  # the lost replica had lines: they ran again on the other one
                assert "runs again: The model replica serving this request went away" in cluster.log_text()
            for line in lines[::8]:
                alone = client.post("/v1/completions", json=line["body"])
                assert alone.status_code == 200, alone.text
                # the same bits, though the line's decode steps were batched with other rows, on either replica
                assert_same_answer(without_ids(output[line["custom_id"]]["body"]), without_ids(alone.json()), SAME)
    finally:
        cluster.terminate()
