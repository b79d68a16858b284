"""The same bits beside other requests, from outside, on the bundled model (float32, `logprobe serve`): a
200-token prompt's `prompt_logprobs` (k 5, with echo and logprobs) and a greedy 24-token generation with
`logprobs: 5`, each sent alone, then again while 7 other texts are scored and 12 sampled streams run,
then once more from the prefix cache: the answers' numbers are the same JSON, value for value.

Slow: 19 requests beside the probes on the real model (about 10 s on 2 vCPUs)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m"
TEXT = ("The harbour master kept a ledger of every ship, its cargo and its crew, and in the margins he noted "
        "the weather, the tides and the gulls that followed the fishing boats home. ")


def post(server: str, body: dict) -> dict:
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, **body}, timeout=None)
    assert r.status_code == 200, r.text
    return r.json()


def numbers(answer: dict) -> list:
    """Everything the answer says about the tokens (not its id, time or usage, whose cached_tokens count
    what the cache held)."""
    return [(c["text"], c["logprobs"], c.get("prompt_logprobs"), c["finish_reason"]) for c in answer["choices"]]


def stream(server: str, seed: int) -> int:
    body = {"model": MODEL, "prompt": TEXT[:40 + 7 * seed], "max_tokens": 24, "temperature": 1.0, "seed": seed,
            "logprobs": 2, "stream": True}
    chunks = 0
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=None) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
    return chunks


def test_a_request_has_the_same_numbers_alone_and_beside_others(server):
    ids = httpx.post(server + "/tokenize", json={"prompt": TEXT * 6}, timeout=None).json()["tokens"][:200]
    scored = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 5, "prompt_logprobs": 5}
    greedy = {"prompt": TEXT[:90], "max_tokens": 24, "temperature": 0, "logprobs": 5}
    alone = [numbers(post(server, scored)), numbers(post(server, greedy))]
    others = [{"prompt": ids[3 * i:3 * i + 60 + 30 * i], "max_tokens": 0, "echo": True, "logprobs": 3}
              for i in range(7)]
    with ThreadPoolExecutor(max_workers=21) as pool:
        background = [pool.submit(stream, server, seed) for seed in range(12)]
        background += [pool.submit(post, server, body) for body in others]
        probes = [pool.submit(post, server, scored), pool.submit(post, server, greedy)]
        beside = [numbers(p.result()) for p in probes]
        for job in background:
            job.result()
    assert beside == alone
    again = [numbers(post(server, scored)), numbers(post(server, greedy))]  # their prefixes now kept
    assert again == alone
