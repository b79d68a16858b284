"""What Ray Serve replicas cost and give on one machine: `logprobe serve` against `logprobe serve --replicas N`.

    python benchmarks/replicas.py [--quick] [--rounds-hop 5] [--hop-requests 20] [--budget 600]

It starts its own servers (benchmarks/servers.py: each in a session of its own, on a free 127.0.0.1 port,
stopped with every Ray process of its session; never `ray stop`) and measures, in one run:

1. The hop: a 1-token request (`/v1/completions`, prompt "Hi", max_tokens 1, temperature 0), sent one
   after another on a keep-alive connection, in rounds that alternate a one-process server and
   `--replicas 1 --cpus-per-replica 2 --ray-cpus 2` (torch on 2 threads in both, as one process has by
   default here), so the difference is the way through Ray: proxy -> ingress -> handle -> replica and
   back. Median and p90 of each, and the difference in ms (pooled, and the median of the per-round ones).
2. Whole-vocabulary answers: `prompt_logprobs: -1`, max_tokens 0, prompts of 8, 32 and 128 tokens, as
   JSON and as `vocab_encoding: "float16"` (dense), on the same two servers in alternating rounds:
   response bytes, seconds to the last byte on each, and the extra seconds per response MB through
   Ray. What crosses Ray is not the JSON: the replica returns [P, V] float32 log probabilities and
   int32 ranks (8 bytes x P x V), and the ingress encodes the response; both sizes are printed.
3. Throughput on the same 2 cores, one server loaded at a time (the previous one stopped first):
   one process; `--replicas 1 --cpus-per-replica 2 --ray-cpus 2`; `--replicas 2 --cpus-per-replica 1
   --ray-cpus 2`. Generation: 16 concurrent clients, greedy, max_tokens 32, logprobs 5, different short
   prompts, a fixed number of requests (64; --quick 16), generated tokens/s. Scoring: `/v1/score`, 16
   concurrent, texts of ~200 tokens (48; --quick 16), scored tokens/s. Two rounds, the second in the
   reverse order of servers (--quick: one round). Per replica, the engine steps and mean rows per step
   from /metrics show how the work was split.

Every loop is bounded in count and in time (--budget seconds in all, shared out per section; a section
that runs out stops taking new requests and reports what it finished). The load generator runs on the
same 2 cores as the servers (the same for every server). Conditions are printed next to the numbers.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import statistics
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import servers  # noqa: E402

MODEL = "smollm2-135m"
VOCAB = 49_152
QUIET = ["--log-level", "warning"]
ONE = ("one process", [])
R1 = ("replicas 1 x 2 thr", ["--replicas", "1", "--cpus-per-replica", "2", "--ray-cpus", "2"])
R2 = ("replicas 2 x 1 thr", ["--replicas", "2", "--cpus-per-replica", "1", "--ray-cpus", "2"])
HI = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
SENTENCES = ["The history of the city goes back to a small settlement on the river.",
             "Scientists measured the temperature of the lake every morning for a year.",
             "She opened the old book and found a letter hidden between the pages.",
             "The committee agreed that the new bridge would be finished by the spring.",
             "Most of the birds leave the island before the first storms of autumn.",
             "A quiet road led through the forest to the house where my grandmother lived."]
STARTS = ["Once upon a time", "My favourite fruit is", "Paris is the capital of", "The best way to learn is",
          "In the morning I", "The weather today is", "Dear friend,", "The recipe calls for",
          "Count: one, two, three,", "Here is a list of animals:", "The train left the station",
          "Water boils at", "The meeting will start", "Our company was founded", "Tomorrow we will",
          "The scientist said that"]


class Clock:
    """The run's time budget: each section gets a deadline out of what is left."""

    def __init__(self, budget: float):
        self.t0 = time.monotonic()
        self.end = self.t0 + budget

    def left(self) -> float:
        return self.end - time.monotonic()

    def deadline(self, share: float) -> float:
        return time.monotonic() + max(5.0, self.left() * share)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def start(spec) -> servers.Server:
    name, flags = spec
    t0 = time.perf_counter()
    server = servers.start(flags + QUIET, prefix="logprobe-replicas-bench-")
    print(f"  started {name:<20} in {time.perf_counter() - t0:5.1f} s  ({' '.join(flags) or 'no flags'})", flush=True)
    return server


def stop(server: servers.Server | None) -> None:
    if server is not None:
        server.terminate()


# ---- 1. the hop ------------------------------------------------------------------------------------

def hop(bases: dict[str, str], rounds: int, per_round: int, deadline: float):
    """Per server: every latency (s), and the per-round medians."""
    lat = {name: [] for name in bases}
    per = {name: [] for name in bases}
    clients = {name: httpx.Client(base_url=base, timeout=60) for name, base in bases.items()}
    try:
        for c in clients.values():
            for _ in range(3):  # warm-up: the connection, the engine's first step
                c.post("/v1/completions", json=HI).raise_for_status()
        names = list(bases)
        for r in range(rounds):
            if time.monotonic() > deadline:
                break
            for name in (names if r % 2 == 0 else names[::-1]):
                times = []
                for _ in range(per_round):
                    t0 = time.perf_counter()
                    clients[name].post("/v1/completions", json=HI).raise_for_status()
                    times.append(time.perf_counter() - t0)
                lat[name] += times
                per[name].append(statistics.median(times))
    finally:
        for c in clients.values():
            c.close()
    return lat, per


# ---- 2. whole vocabulary ---------------------------------------------------------------------------

def timed(client: httpx.Client, body: dict) -> tuple[float, int]:
    t0 = time.perf_counter()
    size = 0
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()[:300]!r}")
        for chunk in r.iter_raw(1 << 20):
            size += len(chunk)
    return time.perf_counter() - t0, size


def whole_vocab(bases: dict[str, str], ids: list[int], lengths: list[int], rounds: int, deadline: float):
    """{(length, encoding): {"bytes": n, server: [seconds...]}}"""
    out = {}
    clients = {name: httpx.Client(base_url=base, timeout=300) for name, base in bases.items()}
    names = list(bases)
    try:
        for c in clients.values():  # warm-up: builds the per-model encoders once
            for enc in (None, "float16"):
                timed(c, {"model": MODEL, "prompt": ids[:4], "max_tokens": 0, "prompt_logprobs": -1,
                          **({"vocab_encoding": enc} if enc else {})})
        for length in lengths:
            for enc in ("json", "float16"):
                body = {"model": MODEL, "prompt": ids[:length], "max_tokens": 0, "prompt_logprobs": -1}
                if enc != "json":
                    body["vocab_encoding"] = enc
                row = out[(length, enc)] = {"bytes": 0, **{n: [] for n in names}}
                for r in range(rounds):
                    if r and time.monotonic() > deadline:  # at least one round of every case
                        break
                    for name in (names if r % 2 == 0 else names[::-1]):
                        seconds, size = timed(clients[name], body)
                        row[name].append(seconds)
                        row["bytes"] = size
    finally:
        for c in clients.values():
            c.close()
    return out


# ---- 3. throughput ---------------------------------------------------------------------------------

def parallel(jobs: list, workers: int, deadline: float):
    """Run callables on `workers` threads (one keep-alive client each) until done or past the deadline;
    (results, wall seconds, jobs not started)."""
    results, lock, queue = [], threading.Lock(), list(jobs)
    errors = []

    def worker():
        with httpx.Client(timeout=300) as client:
            while True:
                with lock:
                    if not queue or time.monotonic() > deadline:
                        return
                    job = queue.pop()
                try:
                    r = job(client)
                except Exception as exc:  # counted and reported, not hidden
                    with lock:
                        errors.append(repr(exc)[:200])
                    continue
                with lock:
                    results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0, len(queue), errors


def gen_job(base: str, i: int):
    body = {"model": MODEL, "prompt": f"{STARTS[i % len(STARTS)]}", "max_tokens": 32, "temperature": 0,
            "logprobs": 5, "seed": i}
    if i >= len(STARTS):  # different prompts: vary the later ones by a number
        body["prompt"] = f"{i}. {STARTS[i % len(STARTS)]}"

    def job(client):
        r = client.post(base + "/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]
    return job


def score_job(base: str, text: str):
    def job(client):
        r = client.post(base + "/v1/score", json={"model": MODEL, "input": text})
        r.raise_for_status()
        return r.json()["usage"]["prompt_tokens"]
    return job


def replica_counters(base: str) -> dict[str, list[float]]:
    """replica -> [engine steps, rows summed over steps, step seconds summed], from /metrics (one process:
    replica '-'; a replica's numbers are its latest report, sent every second)."""
    text = httpx.get(base + "/metrics", timeout=10).text
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        m = re.match(r'logprobe_engine_(batch_rows_count|batch_rows_sum|step_seconds_sum)(\{[^}]*\})? (\S+)', line)
        if m:
            rep = re.search(r'replica="([^"]+)"', m.group(2) or "")
            key = rep.group(1)[-6:] if rep else "-"
            entry = out.setdefault(key, [0.0, 0.0, 0.0])
            entry[["batch_rows_count", "batch_rows_sum", "step_seconds_sum"].index(m.group(1))] += float(m.group(3))
    return out


def cpu_times() -> tuple[float, float, float]:
    """(busy, steal, total) jiffies of all CPUs from /proc/stat: shows a neighbour taking the machine."""
    f = [float(x) for x in open("/proc/stat").readline().split()[1:9]]
    return sum(f) - f[3] - f[4] - f[7], f[7], sum(f)


def load(server: servers.Server, texts: list[str], n_gen: int, n_score: int, deadline: float) -> dict:
    base = server.base
    with httpx.Client(timeout=120) as c:  # warm-up: every replica's first steps (Serve spreads these)
        for i in range(4):
            c.post(base + "/v1/completions", json={**HI, "max_tokens": 4}).raise_for_status()
            c.post(base + "/v1/score", json={"model": MODEL, "input": texts[i % len(texts)]}).raise_for_status()
    time.sleep(2.5)  # replicas report their metrics every second
    before, cpu0 = replica_counters(base), cpu_times()
    mid = time.monotonic() + (deadline - time.monotonic()) * 0.5
    gen, gen_wall, gen_left, gen_err = parallel([gen_job(base, i) for i in range(n_gen)], 16, mid)
    sc, sc_wall, sc_left, sc_err = parallel([score_job(base, texts[i % len(texts)]) for i in range(n_score)], 16,
                                            deadline)
    cpu1 = cpu_times()
    time.sleep(2.5)
    after = replica_counters(base)
    split = {}
    for k, (steps, rows, secs) in after.items():
        s0, r0, t0 = before.get(k, (0.0, 0.0, 0.0))
        if steps - s0 > 0:
            split[k] = (steps - s0, (rows - r0) / (steps - s0), (secs - t0) / (steps - s0))
    span = max(1e-9, cpu1[2] - cpu0[2])
    return {"gen_tps": sum(gen) / gen_wall, "gen_done": len(gen), "gen_tokens": sum(gen), "gen_wall": gen_wall,
            "gen_left": gen_left, "score_tps": sum(sc) / sc_wall, "score_done": len(sc), "score_tokens": sum(sc),
            "score_wall": sc_wall, "score_left": sc_left, "errors": gen_err + sc_err, "split": split,
            "busy": (cpu1[0] - cpu0[0]) / span, "steal": (cpu1[1] - cpu0[1]) / span}


def score_texts(base: str, count: int, tokens: int = 200) -> list[str]:
    out = []
    with httpx.Client(base_url=base, timeout=60) as c:
        for i in range(count):
            words = " ".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(18))  # ~280 tokens, cut
            ids = c.post("/tokenize", json={"prompt": words, "add_special_tokens": False}).json()["tokens"][:tokens]
            out.append(c.post("/detokenize", json={"tokens": ids}).json()["prompt"])
    return out


# ---- the run ---------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller version (a smoke run, ~3 minutes)")
    ap.add_argument("--rounds-hop", type=int, default=None, help="alternating rounds of the hop (5; quick 2)")
    ap.add_argument("--hop-requests", type=int, default=None, help="requests per server per round (20; quick 10)")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole run (600; quick 240)")
    args = ap.parse_args()
    q = args.quick
    rounds_hop = args.rounds_hop or (2 if q else 5)
    per_round = args.hop_requests or (10 if q else 20)
    lengths = [8, 32] if q else [8, 32, 128]
    vocab_rounds = 1 if q else 5
    n_gen, n_score = (16, 16) if q else (64, 48)
    load_rounds = 1 if q else 2
    clock = Clock(args.budget or (240 if q else 600))

    print(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; machine: {os.cpu_count()} CPU "
          f"cores ({platform.processor() or platform.machine()}), python {platform.python_version()}; "
          f"command: python benchmarks/replicas.py {' '.join(sys.argv[1:])}", flush=True)
    import ray
    import torch
    print(f"versions: ray {ray.__version__}, torch {torch.__version__} (default threads {torch.get_num_threads()}); "
          f"model {MODEL} (vocabulary {VOCAB:,}); clients run on the same cores as the servers", flush=True)

    one = r1 = srv = None
    results = {}
    try:
        # ---- 1 and 2: one process and --replicas 1 (2 threads), both up, used one at a time, alternating
        print("\n[1, 2] servers for the hop and the whole-vocabulary answers (both up, only one used at a time)", flush=True)
        one = start(ONE)
        r1 = start(R1)
        bases = {ONE[0]: one.base, R1[0]: r1.base}
        lat, per = hop(bases, rounds_hop, per_round, clock.deadline(0.12))
        text = " ".join(SENTENCES * 4)
        ids = httpx.post(one.base + "/tokenize", json={"prompt": text}).json()["tokens"]
        assert len(ids) >= max(lengths), len(ids)
        vocab = whole_vocab(bases, ids, lengths, vocab_rounds, clock.deadline(0.2))
        stop(one)
        one = None

        # ---- 3: throughput, one server loaded at a time, the others stopped
        print("\n[3] throughput: one server up at a time", flush=True)
        texts = score_texts(r1.base, 16)
        orders = [[R1, R2, ONE], [ONE, R2, R1]][:load_rounds]  # round 2 reversed (R1 is up already)
        load_runs = {spec[0]: [] for spec in (ONE, R1, R2)}
        srv, srv_name = r1, R1[0]
        r1 = None
        for rnd, order in enumerate(orders):
            for spec in order:
                if srv_name != spec[0]:
                    stop(srv)
                    srv = None
                    srv = start(spec)
                    srv_name = spec[0]
                remaining = sum(len(o) for o in orders[rnd:]) - order.index(spec)
                res = load(srv, texts, n_gen, n_score, time.monotonic() + max(20.0, clock.left() / remaining - 25))
                load_runs[spec[0]].append(res)
                print(f"  round {rnd + 1} {spec[0]:<20} generation {res['gen_tps']:6.1f} tok/s "
                      f"({res['gen_done']} requests, {res['gen_tokens']} tokens, {res['gen_wall']:.1f} s)  "
                      f"scoring {res['score_tps']:6.1f} tok/s ({res['score_done']} texts, {res['score_wall']:.1f} s)"
                      + f"  CPU busy {res['busy']:.0%} steal {res['steal']:.0%}"
                      + (f"  NOT STARTED (time): {res['gen_left']} gen, {res['score_left']} score"
                         if res['gen_left'] or res['score_left'] else "")
                      + (f"  ERRORS {len(res['errors'])}: {res['errors'][:2]}" if res["errors"] else ""), flush=True)
        results = dict(lat=lat, per=per, vocab=vocab, load=load_runs)
    finally:
        for s in (one, r1, srv):
            stop(s)
    total = time.monotonic() - clock.t0
    report(results, rounds_hop, per_round, lengths, n_gen, n_score, total)


def report(res: dict, rounds_hop: int, per_round: int, lengths: list[int], n_gen: int, n_score: int, total: float):
    o, r = ONE[0], R1[0]
    lat, per = res["lat"], res["per"]
    n_rounds = len(per[o])
    print(f"\n=== 1. the hop: 1-token request ('Hi', max_tokens 1, greedy), sequential, keep-alive connection; "
          f"{n_rounds} alternating rounds x {per_round} requests per server; torch 2 threads in both ===")
    print(f"{'server':<22}{'median ms':>10}{'p90 ms':>10}{'min ms':>10}   per-round medians (ms)")
    for name in (o, r):
        v = [x * 1e3 for x in lat[name]]
        print(f"{name:<22}{statistics.median(v):10.1f}{pct(v, 0.9):10.1f}{min(v):10.1f}   "
              + ", ".join(f"{x * 1e3:.1f}" for x in per[name]))
    d_med = (statistics.median(lat[r]) - statistics.median(lat[o])) * 1e3
    d_p90 = (pct(lat[r], 0.9) - pct(lat[o], 0.9)) * 1e3
    rounds_d = [(b - a) * 1e3 for a, b in zip(per[o], per[r])]
    print("(both servers up during both; Ray's idle background work - GCS, raylet, Serve controller, "
          "the replica's report every second - runs on the same cores either way)")
    print(f"hop cost (replicas 1 - one process): median {d_med:+.1f} ms, p90 {d_p90:+.1f} ms; per round "
          f"{', '.join(f'{x:+.1f}' for x in rounds_d)} -> median {statistics.median(rounds_d):+.1f} ms; "
          f"ratio of medians {statistics.median(lat[r]) / statistics.median(lat[o]):.2f}x")

    print("\n=== 2. whole vocabulary: prompt_logprobs -1, max_tokens 0, token-id prompts; seconds to the last byte, "
          "median of alternating rounds ===")
    print(f"{'prompt':>7} {'encoding':<8}{'response MB':>12}{'via Ray MB':>11}{'one s':>8}{'Ray s':>8}{'Ray-one s':>10}"
          f"{'extra s/MB':>11}{'one MB/s':>9}{'Ray MB/s':>9}  rounds, min one/Ray s")
    slopes = {"json": [], "float16": []}
    for (length, enc), row in res["vocab"].items():
        mb = row["bytes"] / 1e6
        crossing = length * VOCAB * 8 / 1e6  # [P, V] float32 log probabilities + int32 ranks
        a, b = statistics.median(row[o]), statistics.median(row[r])
        slopes[enc].append((mb, b - a))
        print(f"{length:>7} {enc:<8}{mb:12.2f}{crossing:11.1f}{a:8.3f}{b:8.3f}{b - a:+10.3f}{(b - a) / mb:+11.4f}"
              f"{mb / a:9.1f}{mb / b:9.1f}  {len(row[o])}, {min(row[o]):.3f}/{min(row[r]):.3f}")
    for enc, pts in slopes.items():
        if len(pts) >= 2:
            mx = statistics.mean(p[0] for p in pts)
            my = statistics.mean(p[1] for p in pts)
            sxx = sum((p[0] - mx) ** 2 for p in pts)
            slope = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx else float("nan")
            print(f"  {enc}: least-squares slope of (Ray - one) over response MB: {slope * 1e3:+.1f} ms/MB "
                  f"(intercept {(my - slope * mx) * 1e3:+.0f} ms)")
    print("  'via Ray MB' is what the replica returns to the ingress (8 bytes x positions x vocabulary); the JSON "
          "or float16 response is encoded by the ingress, as in one process, and its bytes then go from the ingress "
          "to Serve's HTTP proxy (another process) as ASGI messages through Ray: a cost per response MB")

    print(f"\n=== 3. throughput on the same 2 cores, one server up at a time: generation = {n_gen} requests, 16 "
          f"concurrent, greedy, max_tokens 32, logprobs 5; scoring = {n_score} x /v1/score of ~200 tokens, "
          f"16 concurrent ===")
    print(f"{'server':<22}{'gen tok/s':>10}{'score tok/s':>12}   rounds (gen / score), per replica (last round): "
          "engine steps x mean rows, mean step time")
    med = {}
    for name, runs in res["load"].items():
        if not runs:
            continue
        g = statistics.median(x["gen_tps"] for x in runs)
        s = statistics.median(x["score_tps"] for x in runs)
        med[name] = (g, s)
        split = "; ".join(f"{k}: {v[0]:.0f} x {v[1]:.1f} rows, {v[2] * 1e3:.0f} ms" for k, v in sorted(runs[-1]["split"].items()))
        print(f"{name:<22}{g:10.1f}{s:12.1f}   " + ", ".join(f"{x['gen_tps']:.1f}/{x['score_tps']:.1f}" for x in runs)
              + f"   [{split}]")
    if all(k in med for k in (o, r, R2[0])):
        g1, s1 = med[r]
        g2, s2 = med[R2[0]]
        g0, s0 = med[o]
        print(f"ratios: 2 replicas x 1 thread / 1 replica x 2 threads: generation {g2 / g1:.2f}x, scoring "
              f"{s2 / s1:.2f}x;  1 replica / one process: generation {g1 / g0:.2f}x, scoring {s1 / s0:.2f}x;  "
              f"2 replicas / one process: generation {g2 / g0:.2f}x, scoring {s2 / s0:.2f}x")
        verdict = lambda x: "about the same" if 0.9 <= x <= 1.1 else ("faster" if x > 1 else "slower")  # noqa: E731
        print(f"on these 2 cores, 2 replicas x 1 thread against 1 replica x 2 threads: generation {g2 / g1:.2f}x "
              f"({verdict(g2 / g1)}), scoring {s2 / s1:.2f}x ({verdict(s2 / s1)}); the best replica setting against "
              f"one process: generation {max(g1, g2) / g0:.2f}x, scoring {max(s1, s2) / s0:.2f}x")
    print("what 2 cores allow: 2 replicas x 1 torch thread or 1 replica x 2 threads, never more compute. With "
          "2 replicas each batch is half as wide on half the threads, so the same work in total; any gain "
          "can only come from overlapping one replica's Python/HTTP/encoding with the other's forward "
          "pass, and the Ray proxy, ingress and GCS/raylet share the same 2 cores with the replicas (and "
          "with this client).")
    print(f"\ntotal run time {total:.0f} s")


if __name__ == "__main__":
    main()
