"""What the Batch API tests share: JSONL files of request lines, an openai client over a TestClient, and
waiting for a batch to end."""

from __future__ import annotations

import math
import time

import orjson

TERMINAL = ("completed", "failed", "expired", "cancelled")


def request_line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(lines: list[dict]) -> bytes:
    return b"\n".join(orjson.dumps(line) for line in lines) + b"\n"


def sdk(client, api_key: str = "unused"):
    """The openai SDK speaking to a TestClient (an httpx.Client), no retries, no default time-out."""
    from openai import OpenAI

    return OpenAI(base_url="http://testserver/v1", api_key=api_key, http_client=client, max_retries=0, timeout=600)


def wait_for(oai, batch_id: str, statuses=TERMINAL, limit_s: float = 600):
    """The batch once its status is one of `statuses` (polled; the limit only stops a hung test)."""
    deadline = time.monotonic() + limit_s
    while True:
        batch = oai.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"batch {batch_id} still {batch.status} after {limit_s} s")
        time.sleep(0.05)


def lines_of(oai, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [orjson.loads(x) for x in oai.files.content(file_id).content.splitlines() if x.strip()]


def without_ids(body):
    """An answer without what differs between two sendings of one body: its id and creation time."""
    if isinstance(body, dict):
        return {k: without_ids(x) for k, x in body.items() if k not in ("id", "created", "request_id")}
    if isinstance(body, list):
        return [without_ids(x) for x in body]
    return body


def assert_same_answer(got, want, tol: float = 1e-5, where: str = "") -> None:
    """The same answer: every key, string, integer and token equal; floats within `tol` (a prompt that
    shares a pass or a cached prefix with another gets the numbers of separate passes within float32
    rounding, docs/api.md), or relative `tol` for large ones (perplexity)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (where, got, want)
        for key in want:
            assert_same_answer(got[key], want[key], tol, f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (where, got, want)
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same_answer(a, b, tol, f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(got, bool):
        assert isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=tol, abs_tol=tol), (where, got, want)
    else:
        assert got == want, (where, got, want)
