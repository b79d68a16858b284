"""A batch on a real `logprobe serve` of the bundled model, killed with SIGKILL and started again on
the same --data-dir: mid-run, and again once every line was answered (while it finalizes). The batch
ends completed with every line in the output exactly once, each answer the one its body gets alone
and the float64 reference's numbers.

The key's token budget (--tokens-per-minute) paces the lines after the first burst, so the first kill
lands mid-run on any machine: a batch line waits for its budget, it does not fail. The lines' prompt
tokens are counted first, so that pacing is checked, not assumed.

Slow: a server killed twice mid-batch and started again, each start loading the model."""

from __future__ import annotations

import signal
import time
from collections import Counter

import httpx
import orjson
import pytest
import serve_process

from batch_helpers import assert_same_answer, jsonl, request_line, without_ids
from logprobe.engine.runners.lean.attention import Attention

pytestmark = pytest.mark.e2e
# a line's answer and its body's alone: the same bits where the attention kernel allows (torch >= 2.13)
SAME = 0.0 if Attention.invariant_kernels() else 1e-4

KEY = "batch-e2e-key"
BUDGET = 2400  # --tokens-per-minute: a bucket of this many tokens, refilled at BUDGET / 60 a second
LINES = 60
WORDS = ["river", "stone", "light", "quiet", "north", "paper", "glass", "field", "night", "storm"]


def body_of(i: int) -> dict:
    words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(20 + (i * 13) % 50)]
    body = {"model": "smollm2-135m", "input": " ".join(words)}
    if i % 4 == 0:
        body["context"] = "A list of words:"
    if i % 5 == 0:
        body["top_logprobs"] = 2
    return body


def start(data_dir):
    return serve_process.start(["--data-dir", str(data_dir), "--api-key", KEY, "--tokens-per-minute", str(BUDGET)])


def http(base: str) -> httpx.Client:
    return httpx.Client(base_url=base, headers={"authorization": f"Bearer {KEY}"}, timeout=600)


def batch_of(client: httpx.Client, batch_id: str) -> dict:
    answer = client.get(f"/v1/batches/{batch_id}")
    assert answer.status_code == 200, answer.text
    return answer.json()


def kill_when(proc, client, batch_id: str, ready) -> dict:
    """SIGKILL the server as soon as `ready(batch)` holds; the batch as last seen."""
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        batch = batch_of(client, batch_id)
        if ready(batch):
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
            return batch
        time.sleep(0.02)
    raise AssertionError(f"batch never reached the kill point: {batch}")


def prompt_tokens(body: dict, tokenizer) -> int:
    """What a score line is charged: `<s>`, the context and the input."""
    texts = [body["input"]] + ([body["context"]] if body.get("context") else [])
    return 1 + sum(len(tokenizer(text, add_special_tokens=False).input_ids) for text in texts)


def test_sigkill_mid_run_and_while_finalizing_then_resume(tmp_path, ref64, tokenizer):
    lines = [request_line(f"line-{i}", "/v1/score", body_of(i)) for i in range(LINES)]
    # past the first burst the lines wait >= 5 s for the refill, whatever the server's speed: the batch
    # is certain to be in progress when 5 lines are answered (a poll every 20 ms sees it)
    assert sum(prompt_tokens(x["body"], tokenizer) for x in lines) - BUDGET >= 5 * BUDGET / 60
    proc, base = start(tmp_path)
    try:
        with http(base) as client:
            uploaded = client.post("/v1/files", data={"purpose": "batch"},
                                   files={"file": ("lines.jsonl", jsonl(lines))}).json()
            batch_id = client.post("/v1/batches", json={"input_file_id": uploaded["id"], "endpoint": "/v1/score",
                                                        "completion_window": "24h"}).json()["id"]
            seen = kill_when(proc, client, batch_id, lambda b: b["request_counts"]["completed"] >= 5)
        assert seen["status"] == "in_progress" and seen["request_counts"]["completed"] < LINES
        proc, base = start(tmp_path)
        with http(base) as client:
            seen = kill_when(proc, client, batch_id, lambda b: b["request_counts"]["completed"] == LINES)
        proc, base = start(tmp_path)
        with http(base) as client:
            deadline = time.monotonic() + 900
            while (batch := batch_of(client, batch_id))["status"] != "completed" and time.monotonic() < deadline:
                time.sleep(0.1)
            assert batch["status"] == "completed" and batch["request_counts"] == {"total": LINES, "completed": LINES,
                                                                                 "failed": 0}
            assert batch["error_file_id"] is None
            raw = client.get(f"/v1/files/{batch['output_file_id']}/content").content
            output = [orjson.loads(x) for x in raw.splitlines()]
            assert Counter(x["custom_id"] for x in output) == Counter(x["custom_id"] for x in lines)
            by_id = {x["custom_id"]: x["response"] for x in output}
            for line in lines[:: LINES // 8]:  # a sample sent alone (each costs the key's budget too)
                alone = client.post("/v1/score", json=line["body"])
                assert alone.status_code == 200, alone.text
                # the same bits, though the server that answered the line was another process
                assert_same_answer(without_ids(by_id[line["custom_id"]]["body"]), without_ids(alone.json()), SAME)
            for line in lines[1:4]:
                check_reference(by_id[line["custom_id"]]["body"], line["body"], ref64, tokenizer)
    finally:
        serve_process.stop(proc)


def check_reference(answer: dict, body: dict, ref64, tokenizer) -> None:
    item = answer["data"][0]
    ids = tokenizer(body["input"], add_special_tokens=False).input_ids
    head = [tokenizer.bos_token_id] + (tokenizer(body["context"], add_special_tokens=False).input_ids
                                       if body.get("context") else [])
    ref = ref64(head + ids)
    want = [ref[len(head) - 1 + i][t] for i, t in enumerate(ids)]
    assert item["token_ids"] == ids
    assert max(abs(a - b) for a, b in zip(item["token_logprobs"], want)) < 2e-4
