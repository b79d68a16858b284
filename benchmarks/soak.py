"""Soak: one long-lived server, a seeded random mix of every kind of request, in bursts with idle gaps.

    python benchmarks/soak.py --minutes 20 [--url http://127.0.0.1:8000] [--seed 0] [serve flags...]

Without --url it starts `logprobe serve` on a free loopback port (extra arguments go to it, e.g.
`--max-model-len 1024 --kv-cache-positions 64`) and measures its RSS; with --url it soaks a running server.

1. The catalog: a seeded list of requests of every kind: greedy generations from 1 token to three times
   the KV cache's first length and one that ends at the context, sampled ones with a seed and n up to 4,
   streamed twins of non-streamed requests, echo, prompt_logprobs k and -1 (dense), /v1/score, chat with
   logprobs (n up to 4, streamed too), activations, and clients that leave mid-request or mid-stream;
   sampling with top-k and top-p, instruments, the logit lens, interventions (with return_unmodified,
   sampled, streamed), and prompt-only requests sharing a long context, alone (the prefix cache) and
   in one request.
2. The reference: every request of the catalog run alone, one after another, on the server as it
   started (before any load).
3. The soak: bursts of 1-8 concurrent requests drawn from the catalog (each request once, in a random
   order, then random draws until the time is up); between bursts no gap, a short
   one, or one longer than the engine's idle delay (0.5 s), so the KV cache grows and shrinks again and
   again. Every answer is checked against its reference: tokens equal (a greedy token may differ only
   where the reference's two likeliest tokens tie within TIE, and the comparison stops there), log
   probabilities within TOL; each stream's chunks joined equal the non-streamed answer, and every choice
   ends exactly once with nothing after its end; no status but 200 (leavers excepted).
4. Afterwards: the hold, the queue and the engine are back to zero and /health says ready.

Printed: requests served, errors by status, mismatches, p50/p99 latency per kind, KV cache sizes seen,
RSS over time (first, max, last) and the server's engine failure counters. `run_soak` is the same code
the test suite's soak (tests/e2e/test_soak.py) runs for about a minute. Every loop is bounded in count
and time, and it only talks to the loopback address it was given.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

# What a loaded server's answer may differ by from the same request's alone (`--exact`, or run_soak's
# `exact`, sets all three to 0: every number the same bits, as the lean runner gives in float32 on torch
# 2.13 or newer; these tolerances are for the settings where the numbers move with what runs beside a
# request: bfloat16, 4-bit weights, older torch).
TOL = 1e-3  # log probabilities: batch shapes differ between a lone run and a loaded one
TIE = 1e-3  # a greedy token may change only where the two likeliest tokens are this close
RANK_TOL = 1e-3  # ranks: another batch shape may order tokens that tie within float32 rounding
IDLE_GAP_S = 0.8  # longer than the engine's idle delay (0.5 s): it shrinks its KV cache
MODEL = "smollm2-135m"
TEXTS = ["The history of the city goes back to a small settlement on the river.",
         "Scientists measured the temperature of the lake every morning for a year.",
         "She opened the old book and found a letter hidden between the pages.",
         "Once upon a time", "My favourite fruit is", "Paris is the capital of", "Count: one, two, three,"]


@dataclass
class Spec:
    kind: str
    path: str
    body: dict
    stream: bool = False
    leave: str | None = None  # "stream" (after 3 events) or "read" (read time-out) for leaving clients
    greedy: bool = False


def build_catalog(rng: random.Random, first_len: int, context: int, long_prompt: list[int]) -> list[Spec]:
    """Requests of every kind, with lengths drawn from `rng`. `first_len` is the KV cache's first length
    per sequence, `context` the served context, `long_prompt` token ids to cut a near-context prompt from."""
    out: list[Spec] = []
    text = lambda: rng.choice(TEXTS)  # noqa: E731

    def add(kind, path, body, **kw):
        out.append(Spec(kind, path, {"model": MODEL, **body}, **kw))

    for n_tokens in [1, 2, rng.randint(3, 16), rng.randint(17, first_len)]:
        add("greedy", "/v1/completions", {"prompt": text(), "max_tokens": n_tokens, "temperature": 0,
                                          "logprobs": 3}, greedy=True)
    for _ in range(3):  # past the cache's first length: it grows inside decode steps
        n_tokens = rng.randint(first_len + 1, 3 * first_len)
        add("greedy_long", "/v1/completions", {"prompt": text(), "max_tokens": n_tokens, "temperature": 0,
                                               "logprobs": 2, "stop": ["\n\n\n\n"]}, greedy=True)
    prompt = long_prompt[: context - 24]
    add("near_context", "/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0, "logprobs": 2},
        greedy=True)
    for i in range(4):
        body = {"prompt": text(), "max_tokens": rng.randint(4, 40), "temperature": 1.0, "seed": 100 + i,
                "n": rng.randint(2, 4), "logprobs": rng.randint(0, 5), "stop": [rng.choice([" the", ".", "\n"])]}
        add("sampled", "/v1/completions", body)
        add("sampled_stream", "/v1/completions", {**body, "stream": True}, stream=True)
    greedy_stream = {"prompt": text(), "max_tokens": rng.randint(first_len, 2 * first_len), "temperature": 0,
                     "logprobs": 2, "echo": True}
    add("greedy_echo", "/v1/completions", greedy_stream, greedy=True)
    add("greedy_echo_stream", "/v1/completions", {**greedy_stream, "stream": True}, stream=True, greedy=True)
    add("echo_score", "/v1/completions", {"prompt": text(), "max_tokens": 0, "echo": True, "logprobs": 2})
    add("prompt_logprobs", "/v1/completions", {"prompt": text(), "max_tokens": 3, "temperature": 0,
                                               "prompt_logprobs": 3}, greedy=True)
    add("whole_vocab", "/v1/completions", {"prompt": "A short text", "max_tokens": 1, "temperature": 0,
                                           "prompt_logprobs": -1, "vocab_encoding": "float32"}, greedy=True)
    add("score", "/v1/score", {"input": [text(), text()], "top_logprobs": 2})
    add("score_activations", "/v1/score", {"input": text(), "output_residual_stream": [0, 3, -1]})
    add("activations", "/v1/completions", {"prompt": text(), "max_tokens": 6, "temperature": 0,
                                           "output_residual_stream": {"layers": [1, -1], "dtype": "float32"}},
        greedy=True)
    for i in range(2):
        chat = {"messages": [{"role": "user", "content": text()}], "max_tokens": rng.randint(8, 48),
                "logprobs": True, "top_logprobs": 2, "temperature": 0.8, "seed": 7 + i, "n": rng.randint(1, 4)}
        add("chat", "/v1/chat/completions", chat)
        add("chat_stream", "/v1/chat/completions", {**chat, "stream": True}, stream=True)
    add("chat_greedy", "/v1/chat/completions", {"messages": [{"role": "user", "content": text()}],
                                                "max_tokens": 32, "logprobs": True, "top_logprobs": 2,
                                                "temperature": 0}, greedy=True)
    leaver = {"prompt": text(), "max_tokens": 3 * first_len, "temperature": 1.0, "seed": 9, "n": 2}
    add("leave_stream", "/v1/completions", {**leaver, "stream": True}, stream=True, leave="stream")
    add("leave_read", "/v1/completions", leaver, leave="read")
    # filters (their batches pick after the pass), instruments, the logit lens, interventions (eager
    # decode steps beside plain ones), and prompt-only requests sharing a context (in one batch, and
    # across batches through the prefix cache)
    filtered = {"prompt": text(), "max_tokens": rng.randint(4, 24), "temperature": 0.9, "top_k": 20, "top_p": 0.9,
                "seed": 300, "n": 2, "logprobs": 2}
    add("sampled_filters", "/v1/completions", filtered)
    add("sampled_filters_stream", "/v1/completions", {**filtered, "stream": True}, stream=True)
    add("instruments", "/v1/completions", {"prompt": text(), "max_tokens": rng.randint(2, 12), "temperature": 0.7,
                                           "seed": 11, "logprobs": 2, "logprob_token_ids": [330, 389, 1],
                                           "position_stats": True, "top_logprobs_p": 0.5, "logprobs_mode": "both"})
    add("logit_lens", "/v1/completions", {"prompt": text(), "max_tokens": 4, "temperature": 0,
                                          "output_lens": {"layers": [4, -1], "top_k": 2}}, greedy=True)
    steer = [{"layer": 8, "op": "scale", "factor": 1.5, "positions": [-1]},
             {"layer": 16, "op": "patch", "source": {"prompt": text(), "position": -1}, "positions": [-1, -2]},
             {"layer": 20, "op": "zero", "positions": [0]}]
    steered = {"prompt": text(), "max_tokens": rng.randint(3, first_len), "temperature": 0, "logprobs": 2,
               "interventions": steer}
    add("interventions", "/v1/completions", {**steered, "return_unmodified": True, "prompt_logprobs": 1},
        greedy=True)
    add("interventions_sampled", "/v1/completions", {**steered, "temperature": 1.0, "seed": 21, "n": 2})
    add("interventions_sampled_stream", "/v1/completions",
        {**steered, "temperature": 1.0, "seed": 21, "n": 2, "stream": True}, stream=True)
    context_text = " ".join(TEXTS[:3])
    for answer in rng.sample(TEXTS, 3):  # each alone: the context's blocks come from the prefix cache
        add("shared_context", "/v1/completions", {"prompt": f"{context_text} {answer}", "max_tokens": 0,
                                                  "echo": True, "logprobs": 2})
    add("shared_context_batch", "/v1/completions",
        {"prompt": [f"{context_text} {answer}" for answer in TEXTS[:4]], "max_tokens": 0, "echo": True,
         "logprobs": 1})
    return out


# ---- answers --------------------------------------------------------------------------------------

def _residual(data: dict) -> dict:
    arrays = {}
    for key, value in data["data"].items():
        arrays[key] = np.frombuffer(base64.b64decode(value), dtype="<f4") if isinstance(value, str) else np.asarray(value)
    return {"shape": (data["num_positions"], data["d_model"]), "arrays": arrays}


def stable(spec: Spec, payload: dict):
    """What must not change between runs of one request (ids and times dropped), per choice."""
    if spec.path == "/v1/score":
        out = []
        for d in payload["data"]:
            d = dict(d)
            if "residual_stream" in d:
                d["residual_stream"] = _residual(d["residual_stream"])
            out.append(d)
        return out
    out = []
    for c in payload["choices"]:
        if "message" in c:
            entry = {"text": c["message"]["content"], "logprobs": c["logprobs"], "finish": c["finish_reason"]}
        else:
            entry = {"text": c["text"], "logprobs": c["logprobs"], "finish": c["finish_reason"]}
            pl = c.get("prompt_logprobs")
            if pl and isinstance(pl[-1], dict) and isinstance(pl[-1].get("logprobs"), str):  # dense
                pl = [None] + [{**e, "logprobs": np.frombuffer(base64.b64decode(e["logprobs"]), dtype="<f4")}
                               for e in pl[1:]]
            entry["prompt_logprobs"] = pl
        if "residual_stream" in c:
            entry["residual_stream"] = _residual(c["residual_stream"])
        for block in ("logit_lens", "unmodified", "logprob_token_ids", "position_stats", "processed_logprobs"):
            if block in c:
                entry[block] = c[block]
        out.append(entry)
    return out


def join_stream(raw: str, chat: bool) -> tuple[list[dict], list[str]]:
    """The choices of an SSE stream, joined as the non-streamed answer would be, and the problems seen:
    a choice that ends more or less than once, a chunk after a choice's end, an error event."""
    events = [e[6:] for e in raw.split("\n\n") if e.startswith("data: ")]
    problems = []
    if not events or events[-1] != "[DONE]":
        return [], ["the stream did not end with [DONE]"]
    choices: dict[int, dict] = {}
    ended: dict[int, int] = {}
    for raw_event in events[:-1]:
        chunk = json.loads(raw_event)
        if "error" in chunk:
            problems.append(f"error event: {chunk['error'].get('message')}")
            continue
        for c in chunk["choices"]:
            i = c["index"]
            if ended.get(i):
                problems.append(f"choice {i} sent a chunk after its finish_reason")
            agg = choices.setdefault(i, {"text": "", "logprobs": None, "finish": None})
            if chat:
                agg["text"] += c["delta"].get("content", "")
                if c.get("logprobs"):
                    agg["logprobs"] = agg["logprobs"] or {"content": [], "refusal": None}
                    agg["logprobs"]["content"] += c["logprobs"]["content"]
            else:
                agg["text"] += c["text"]
                if c["logprobs"]:
                    agg["logprobs"] = agg["logprobs"] or {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                          "text_offset": []}
                    for key in agg["logprobs"]:
                        agg["logprobs"][key] += c["logprobs"][key]
            if c["finish_reason"] is not None:
                ended[i] = ended.get(i, 0) + 1
                agg["finish"] = c["finish_reason"]
    for i in choices:
        if ended.get(i, 0) != 1:
            problems.append(f"choice {i} ended {ended.get(i, 0)} times")
    return [choices[i] for i in sorted(choices)], problems


def _tie_at(choice: dict, i: int) -> bool:
    """Whether the reference's two likeliest tokens at generated position i tie within TIE."""
    lp = choice.get("logprobs") or {}
    tops = lp.get("top_logprobs") or [entry.get("top_logprobs") for entry in lp.get("content", [])]
    if i >= len(tops) or not tops[i]:
        return False
    values = sorted((v if isinstance(v, (int, float)) else v["logprob"] for v in
                     (tops[i].values() if isinstance(tops[i], dict) else tops[i])), reverse=True)
    return len(values) >= 2 and values[0] - values[1] <= TIE


def _truncate(choice: dict, n: int) -> dict:
    """A greedy choice's first n tokens' numbers, for comparing up to a tie."""
    lp = choice.get("logprobs") or {}
    if "content" in lp:
        return {"content": lp["content"][:n]}
    return {key: lp[key][:n] for key in ("token_logprobs", "top_logprobs")}


def _tokens(choice: dict) -> list:
    lp = choice.get("logprobs") or {}
    if "content" in lp:
        return [e["token"] for e in lp["content"]]
    return list(lp.get("tokens", []))


def compare(got, want, greedy: bool, where: str = "") -> list[str]:
    """Differences between an answer and its reference, as messages (empty: they agree)."""
    if greedy and isinstance(got, list) and got and isinstance(got[0], dict) and "finish" in got[0]:
        if len(got) != len(want):
            return [f"{where}: {len(got)} choices, reference {len(want)}"]
        problems = []
        for j, (g, w) in enumerate(zip(got, want)):
            first = next((i for i, (a, b) in enumerate(zip(_tokens(g), _tokens(w))) if a != b), None)
            if first is not None and _tie_at(w, first):  # top_logprobs are aligned with the tokens
                problems += _close(_truncate(g, first), _truncate(w, first), f"{where}[{j}] up to a tie at {first}")
            else:
                problems += _close(g, w, f"{where}[{j}]")
        return problems
    return _close(got, want, where)


def _close(a, b, where: str, rank: bool = False) -> list[str]:
    """Equal, with floats within TOL; a top-k map may swap entries whose values tie within TOL; a rank
    (under a key named `rank` or `...ranks`) within RANK_TOL of itself: deep in the tail thousands of
    tokens lie within float32 rounding of each other, and another batch shape may order two of them
    the other way (ranks up to 1 / RANK_TOL must be equal)."""
    if rank and isinstance(a, int) and isinstance(b, int):
        return [] if abs(a - b) <= RANK_TOL * max(a, b) else [f"{where}: rank {a} != {b}"]
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if a.shape != b.shape:
            return [f"{where}: shape {a.shape} != {b.shape}"]
        bad = ~np.isclose(a, b, rtol=TOL, atol=TOL, equal_nan=True)
        return [f"{where}: {int(bad.sum())} values differ beyond {TOL}"] if bad.any() else []
    if isinstance(a, float) or isinstance(b, float):
        if a is None or b is None or abs(a - b) > TOL * max(1.0, abs(a)):
            return [f"{where}: {a} != {b}"]
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        problems = []
        if set(a) != set(b) and all(isinstance(x, (int, float)) for x in list(a.values()) + list(b.values())):
            floor = min(min(a.values()), min(b.values()))
            for key in set(a) ^ set(b):
                if a.get(key, b.get(key)) > floor + TOL:
                    problems.append(f"{where}: top-k maps differ beyond a tie at {key!r}")
            for key in set(a) & set(b):
                problems += _close(a[key], b[key], f"{where}.{key}")
            return problems
        if set(a) != set(b):
            return [f"{where}: keys {sorted(a)} != {sorted(b)}"]
        for key in a:
            problems += _close(a[key], b[key], f"{where}.{key}", rank=key == "rank" or str(key).endswith("ranks"))
        return problems
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} != {len(b)}"]
        problems = []
        for i, (x, y) in enumerate(zip(a, b)):
            problems += _close(x, y, f"{where}[{i}]", rank)
            if len(problems) > 5:
                break
        return problems
    return [] if a == b else [f"{where}: {str(a)[:80]!r} != {str(b)[:80]!r}"]


# ---- running requests -----------------------------------------------------------------------------

@dataclass
class Results:
    served: int = 0
    left: int = 0
    statuses: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)
    latency: dict = field(default_factory=dict)  # kind -> [seconds]
    kv_bytes: list = field(default_factory=list)  # (time, bytes) sampled between bursts
    rss_mb: list = field(default_factory=list)  # (time, MB) after each burst
    rss_idle_mb: list = field(default_factory=list)  # (time, MB) after idle gaps in which the KV cache shrank
    prefix_idle_mb: list = field(default_factory=list)  # the prefix cache's MB at each of those times (kept when idle)
    shrinks: int = 0  # idle gaps after which the KV cache was back at its first size, having grown
    kinds: set = field(default_factory=set)  # the kinds of request in the catalog


async def watch_kv(client: httpx.AsyncClient, peak: list) -> None:
    """Keep peak[0] at the largest KV cache size seen, polling until cancelled."""
    while True:
        peak[0] = max(peak[0], await metric(client, "logprobe_kv_cache_bytes"))
        await asyncio.sleep(0.05)


async def send(client: httpx.AsyncClient, spec: Spec) -> tuple[int, object, str]:
    """(status, answer or problems, raw text on failure). A leaver's status is 0."""
    if spec.leave == "stream":
        async with client.stream("POST", spec.path, json=spec.body) as r:
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen == 3:
                    break
        return 0, None, ""
    if spec.leave == "read":
        try:
            await client.post(spec.path, json=spec.body, timeout=httpx.Timeout(60, read=0.3))
        except httpx.ReadTimeout:
            pass
        return 0, None, ""
    r = await client.post(spec.path, json=spec.body)
    if r.status_code != 200:
        return r.status_code, None, r.text[:300]
    if spec.stream:
        return 200, join_stream(r.text, chat=spec.path.endswith("chat/completions")), ""
    return 200, stable(spec, r.json()), ""


def twin_of(spec: Spec, catalog: list[Spec]) -> Spec:
    """The non-streamed request a streamed one must equal."""
    body = {k: v for k, v in spec.body.items() if k != "stream"}
    return next(s for s in catalog if not s.stream and s.body == body)


async def references(base: str, catalog: list[Spec]) -> dict[int, object]:
    """Every non-streamed request of the catalog run alone, in order."""
    out = {}
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        for i, spec in enumerate(catalog):
            if spec.stream or spec.leave:
                continue
            status, answer, text = await send(client, spec)
            if status != 200:
                raise RuntimeError(f"reference {spec.kind} answered {status}: {text}")
            out[i] = answer
    return out


def check(spec: Spec, answer, catalog: list[Spec], refs: dict[int, object]) -> list[str]:
    if spec.stream:
        joined, problems = answer
        want = refs[catalog.index(twin_of(spec, catalog))]
        want = [{k: v for k, v in c.items() if k in ("text", "logprobs", "finish")} for c in want]
        return problems + compare(joined, want, spec.greedy, spec.kind)
    return compare(answer, refs[catalog.index(spec)], spec.greedy, spec.kind)


async def metric(client: httpx.AsyncClient, name: str) -> float:
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


async def soak(base: str, catalog: list[Spec], refs: dict, rng: random.Random, seconds: float,
               max_requests: int, pid: int | None = None, report=None) -> Results:
    res = Results()
    deadline = time.monotonic() + seconds
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=16, max_keepalive_connections=16, keepalive_expiry=2)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        await asyncio.sleep(IDLE_GAP_S)  # the references' last request is over: the cache is back at its first size
        first_kv = await metric(client, "logprobe_kv_cache_bytes")
        grown = False
        sent = 0
        next_report = time.monotonic() + 60

        async def one(spec: Spec):
            start = time.monotonic()
            status, answer, text = await send(client, spec)
            res.latency.setdefault(spec.kind, []).append(time.monotonic() - start)
            res.statuses[status] = res.statuses.get(status, 0) + 1
            if status == 0:
                res.left += 1
                return
            if status != 200:
                res.problems.append(f"{spec.kind}: status {status}: {text}")
                return
            res.served += 1
            res.problems.extend(check(spec, answer, catalog, refs))

        first_round = catalog[:]  # every request once, in a random order, then random draws
        rng.shuffle(first_round)
        while first_round or (time.monotonic() < deadline and sent < max_requests):
            size = rng.randint(1, 8)
            burst = [first_round.pop() if first_round else rng.choice(catalog) for _ in range(size)]
            sent += len(burst)
            peak = [0]  # the KV cache's size while the burst runs (its larger classes go when their rows end)
            watcher = asyncio.ensure_future(watch_kv(client, peak))
            try:
                await asyncio.gather(*(one(s) for s in burst))
            finally:
                watcher.cancel()
            kv = await metric(client, "logprobe_kv_cache_bytes")
            grown = grown or max(kv, peak[0]) > first_kv
            res.kv_bytes.append((time.monotonic() - t0, kv))
            gap = rng.choice([0.0, 0.1, IDLE_GAP_S, IDLE_GAP_S])
            if gap:
                await asyncio.sleep(gap)
                if gap >= IDLE_GAP_S:
                    kv_after = await metric(client, "logprobe_kv_cache_bytes")
                    if grown and kv_after == first_kv:
                        res.shrinks += 1
                        grown = False
                        if pid is not None:
                            res.rss_idle_mb.append((time.monotonic() - t0, _rss_mb(pid)))
                            res.prefix_idle_mb.append(await metric(client, "logprobe_prefix_cache_bytes") / 2**20)
            if pid is not None:
                res.rss_mb.append((time.monotonic() - t0, _rss_mb(pid)))
            if report is not None and time.monotonic() >= next_report:
                next_report += 60
                report(res, time.monotonic() - t0)
    return res


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def long_prompt(base: str, context: int) -> list[int]:
    ids: list[int] = []
    text = " ".join(TEXTS) + " "
    while len(ids) < context:
        ids = httpx.post(base + "/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False},
                         timeout=60).json()["tokens"]
        text += text
    return ids


def run_soak(base: str, seed: int, seconds: float, first_len: int = 256, max_requests: int = 100_000,
             pid: int | None = None, report=None, exact: bool = False) -> tuple[Results, dict]:
    """Catalog, references and soak against the server at `base` (whose KV cache starts at `first_len`
    positions per sequence: --kv-cache-positions); returns the results and the server's health
    afterwards (once idle). `exact`: every answer must have its reference's bits (no tolerance)."""
    global TOL, TIE, RANK_TOL
    if exact:
        TOL = TIE = RANK_TOL = 0.0
    card = httpx.get(base + f"/v1/models/{MODEL}", timeout=30).json()
    context = card["context_length"]
    rng = random.Random(seed)
    catalog = build_catalog(rng, first_len, context, long_prompt(base, context))
    refs = asyncio.run(references(base, catalog))
    res = asyncio.run(soak(base, catalog, refs, rng, seconds, max_requests, pid, report))
    res.kinds = {spec.kind for spec in catalog}
    deadline = time.time() + 60
    health = httpx.get(base + "/health", timeout=30).json()
    while time.time() < deadline and any(health[k] for k in ("requests_running", "requests_queued", "tokens_held",
                                                                "in_flight")):
        time.sleep(0.1)
        health = httpx.get(base + "/health", timeout=30).json()
    return res, health


def summary(res: Results, health: dict, seconds: float) -> str:
    lines = [f"soak: {seconds / 60:.1f} min, {res.served} answers checked, {res.left} clients left mid-request; "
             f"statuses {dict(sorted(res.statuses.items()))}; {len(res.problems)} mismatches or errors; "
             f"KV cache back at its first size after {res.shrinks} idle gaps"]
    lines.append(f"{'kind':<20} {'count':>6} {'p50 ms':>9} {'p99 ms':>9}")
    for kind, values in sorted(res.latency.items()):
        values = sorted(values)
        p99 = values[min(len(values) - 1, int(0.99 * len(values)))]
        lines.append(f"{kind:<20} {len(values):>6} {statistics.median(values) * 1000:>9.0f} {p99 * 1000:>9.0f}")
    if res.kv_bytes:
        kv = [b / 2**20 for _, b in res.kv_bytes]
        lines.append(f"KV cache between bursts: min {min(kv):.1f} MB, max {max(kv):.1f} MB")
    if res.rss_mb:
        rss = [m for _, m in res.rss_mb]
        lines.append(f"RSS after bursts: first {rss[0]:.0f} MB, max {max(rss):.0f} MB, last {rss[-1]:.0f} MB "
                     f"({len(rss)} samples)")
    if res.rss_idle_mb:
        rss = [m for _, m in res.rss_idle_mb]
        lines.append(f"RSS when idle (the KV cache back at its first size): first {rss[0]:.0f} MB, "
                     f"max {max(rss):.0f} MB, last {rss[-1]:.0f} MB ({len(rss)} samples)")
        if res.prefix_idle_mb:
            lines.append(f"the prefix cache then: first {res.prefix_idle_mb[0]:.0f} MB, max {max(res.prefix_idle_mb):.0f} "
                         f"MB, last {res.prefix_idle_mb[-1]:.0f} MB")
    lines.append(f"afterwards: /health {health['status']}, running {health['requests_running']}, queued "
                 f"{health['requests_queued']}, held {health['tokens_held']}, in flight {health['in_flight']}, "
                 f"engine failures {health.get('engine_failures')}")
    for p in res.problems[:20]:
        lines.append("  " + p)
    return "\n".join(lines)


def start_server(flags: list[str]) -> tuple[subprocess.Popen, str, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.NamedTemporaryFile(prefix="logprobe-soak-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "logprobe.cli", "serve", "--port", str(port), *flags],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited: see " + log.name)
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base, log.name
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", help="soak a running server instead of starting one")
    parser.add_argument("--exact", action="store_true",
                        help="every answer must have its reference's bits (a float32 server on the lean runner, "
                             "torch 2.13 or newer); without it, numbers within 1e-3")
    args, serve_flags = parser.parse_known_args()
    proc = None
    if args.url:
        base, pid = args.url.rstrip("/"), None
    else:
        proc, base, log = start_server(serve_flags)
        pid = proc.pid
        print(f"server: logprobe serve {' '.join(serve_flags)} at {base} (log {log})", flush=True)
    first_len = 256
    if "--kv-cache-positions" in serve_flags:
        first_len = int(serve_flags[serve_flags.index("--kv-cache-positions") + 1])
    started = time.monotonic()
    try:
        res, health = run_soak(base, args.seed, args.minutes * 60, first_len=first_len, pid=pid, exact=args.exact,
                               report=lambda r, t: print(f"  {t / 60:.1f} min: {r.served} checked, statuses "
                                                         f"{r.statuses}, {len(r.problems)} problems, RSS "
                                                         f"{r.rss_mb[-1][1] if r.rss_mb else float('nan'):.0f} MB",
                                                         flush=True))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    print(summary(res, health, time.monotonic() - started))
    bad = res.problems or any(s >= 500 for s in res.statuses) or health["status"] != "ready"
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
