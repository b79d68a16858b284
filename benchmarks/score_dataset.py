"""Scoring a dataset (docs/datasets.md): the in-process job against the other ways to get the same numbers.

`--rows` texts of varied length (1 to 48 words, log-spaced, random words: no prefix cache serves a row
twice) are scored, at one dtype, by

- **in-process**: `logprobe.datasets.job.run` on a started `InProcessScorer` (the `logprobe score --input`
  path, the output file written; the model load is not timed),
- **loop**: one `/v1/score` request per row, one after another, on one keep-alive connection to a
  `logprobe serve` of the same model and dtype,
- **8 clients**: the same requests from 8 threads, each with its own keep-alive connection,
- **transformers**: a hand-written batch loop, as a researcher writes it: rows sorted by length, batches
  of 16 padded on the right, a forward, log_softmax, each target token's log probability, summed per row,

and the figure is scored tokens per second (BOS first, as logprobe scores by default; the transformers
loop is given the same BOS). The rows are split into `--rounds` rounds; in every round each arm scores
that round's rows, the arms taking turns in an order that alternates between rounds, because this
machine's speed drifts by up to 2x within minutes; the ratios printed are medians of the per-round
ratios to the in-process job. The two HTTP arms score every `--http-every`-th row of a round (the same
mix of lengths), so that a run fits in minutes; their rate is that subset's. `--ray` adds the whole job
on a local Ray with 2 workers against the whole in-process job, on `--ray-rows` rows, both timed with
their model loads (the Ray job starts its actors and loads the model in each; Ray itself is started
before the clock).

The matmul ceiling line, printed before the rounds: the model's multiply-adds per scored token (every
block's projections and MLP, and the head; 2 FLOPs a weight, from the model's config; attention's own
products, under 1% at these lengths, and BOS and padding left out, so a fraction is of useful work) and a
bare [1024, D] x [D, I] product's rate at each dtype. Tokens per second at that rate is what no arm can
pass; each arm's fraction of it is printed with its rate.

The products bound, printed after the rounds, counts more exactly and is still one no arm can pass:
every product the model makes for these rows (each block's [q; k; v], o, [gate; up] and down for every
row's tokens and its BOS, which every arm runs; the head for every scored position), each at the best
rate a bare product of its own shape reaches here (weights packed for oneDNN or not, 256 to 4,096 rows),
with nothing else costing any time: no attention, norm, log_softmax, rank, padding or I/O. Beside it,
what 2x the transformers loop would be, as a fraction of that bound.

    python benchmarks/score_dataset.py [--rows 5000] [--rounds 5] [--http-every 5] [--dtype float32|bfloat16]
                                       [--ray] [--ray-rows 1000] [--skip-transformers]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import servers  # noqa: E402  (benchmarks/servers.py)

MODEL = "smollm2-135m"
LENGTHS = (1, 2, 3, 6, 12, 24, 48)  # words a row, in equal shares (~16 tokens a row on average)
WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level").split()


def make_rows(count: int, salt: int) -> list[str]:
    """`count` texts of random words, lengths cycling through LENGTHS, in a shuffled order."""
    rng = random.Random(salt)
    texts = [" ".join(rng.choice(WORDS).capitalize() if j == 0 else rng.choice(WORDS)
                      for j in range(LENGTHS[i % len(LENGTHS)])) + "." for i in range(count)]
    rng.shuffle(texts)
    return texts


def write_input(texts: list[str], folder: str) -> str:
    path = os.path.join(folder, "rows.txt")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("".join(t + "\n" for t in texts))
    return path


def in_process(scorer, texts: list[str], folder: str) -> tuple[int, float]:
    from logprobe.datasets import job
    import pyarrow.parquet as pq

    source, out = write_input(texts, folder), os.path.join(folder, "out.parquet")
    started = time.perf_counter()
    job.run(source, out, scorer, scorer.options, resume=False, progress="none")
    wall = time.perf_counter() - started
    return sum(pq.read_table(out, columns=["num_tokens"]).column(0).to_pylist()), wall


def request_loop(base: str, texts: list[str], clients: int) -> tuple[int, float]:
    """One /v1/score request per text from `clients` threads, each on its own keep-alive connection."""
    totals = [0] * clients
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            with httpx.Client(base_url=base, timeout=None) as client:
                for text in texts[k::clients]:
                    r = client.post("/v1/score", json={"model": MODEL, "input": text})
                    r.raise_for_status()
                    totals[k] += r.json()["data"][0]["num_tokens"]
        except BaseException as exc:  # reported by the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    return sum(totals), wall


class TransformersLoop:
    """The hand-written batch loop: sorted by length, batches of 16 padded on the right, BOS first."""

    def __init__(self, model_dir: str, dtype: str, batch: int = 16):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch, self.batch = torch, batch
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        self.bos = self.tok.bos_token_id

    def __call__(self, texts: list[str]) -> tuple[int, float]:
        torch = self.torch
        started = time.perf_counter()
        encoded = sorted(([self.bos] + self.tok(t, add_special_tokens=False).input_ids for t in texts), key=len)
        scored = 0
        with torch.inference_mode():
            for start in range(0, len(encoded), self.batch):
                rows = encoded[start:start + self.batch]
                width = max(map(len, rows))
                ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
                mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
                logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
                logprobs = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None])[..., 0]
                (logprobs * mask[:, 1:]).sum(1)
                scored += int(mask[:, 1:].sum())
        return scored, time.perf_counter() - started


def flops_per_token(model_dir: str) -> tuple[float, float, int, int]:
    """(blocks' FLOPs, the head's FLOPs, hidden size, MLP size) per scored token, from the model's config."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q_and_o = 2 * c.hidden_size * c.num_attention_heads * head_dim
    k_and_v = 2 * c.hidden_size * c.num_key_value_heads * head_dim
    mlp = 3 * c.hidden_size * c.intermediate_size  # gate, up, down
    blocks = 2 * c.num_hidden_layers * (q_and_o + k_and_v + mlp)
    return blocks, 2 * c.hidden_size * c.vocab_size, c.hidden_size, c.intermediate_size


def matmul_rate(dtype: str, rows: int, inner: int, outer: int, seconds: float = 2.0) -> float:
    """FLOP/s of a bare [rows, inner] x [inner, outer] product at `dtype`: the best of repeats for `seconds`."""
    import torch

    a = torch.randn(rows, inner, dtype=getattr(torch, dtype))
    w = torch.randn(outer, inner, dtype=getattr(torch, dtype))
    best, stop = float("inf"), time.perf_counter() + seconds
    a @ w.T  # warm-up
    while time.perf_counter() < stop:
        started = time.perf_counter()
        a @ w.T
        best = min(best, time.perf_counter() - started)
    return 2 * rows * inner * outer / best


def product_rates(shape: tuple[int, int], dtype: str, seconds: float = 0.4) -> float:
    """The best FLOP/s a bare product of weight `shape` ([out, in]) reaches at `dtype` here: plain and with
    the weight packed for oneDNN (as the lean runner multiplies in bfloat16), at 256, 1,024 and 4,096 rows."""
    import torch

    out_size, in_size = shape
    best = 0.0
    for rows in (256, 1024, 4096):
        a = torch.randn(rows, in_size, dtype=getattr(torch, dtype))
        w = torch.randn(out_size, in_size, dtype=getattr(torch, dtype))
        products = [lambda: a @ w.T]
        if dtype != "float32" and torch.backends.mkldnn.is_available():
            packed = torch.ops.mkldnn._reorder_linear_weight(w)
            products.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
        for product in products:
            product()  # warm-up
            stop = time.perf_counter() + seconds
            while time.perf_counter() < stop:
                started = time.perf_counter()
                product()
                best = max(best, 2 * rows * in_size * out_size / (time.perf_counter() - started))
    return best


def products_bound(model_dir: str, dtype: str) -> tuple[float, float]:
    """(seconds a token's pass through the blocks' products takes, seconds a scored position's head
    product takes), each product at `product_rates` of its shape: what no engine of these weights beats."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    shapes = [((c.num_attention_heads + 2 * c.num_key_value_heads) * d, c.hidden_size),  # [q; k; v]
              (c.hidden_size, c.num_attention_heads * d), (2 * c.intermediate_size, c.hidden_size),
              (c.hidden_size, c.intermediate_size)]
    block = c.num_hidden_layers * sum(2 * o * i / product_rates((o, i), dtype) for o, i in shapes)
    head = 2 * c.vocab_size * c.hidden_size / product_rates((c.vocab_size, c.hidden_size), dtype)
    return block, head


def ray_against_in_process(source: str, folder: str, dtype: str) -> None:
    """The whole job, model loads included: in process, then on a local Ray of 2 workers."""
    from logprobe.datasets import job, ray_job
    from logprobe.datasets.columns import ScoreOptions
    from logprobe.datasets.scorer import InProcessScorer

    ray_job.start_ray(None, workers=2)
    for name in ("in-process", "ray x2", "in-process", "ray x2"):
        out = os.path.join(folder, f"{name}.parquet")
        started = time.perf_counter()
        if name == "in-process":
            job.run(source, out, lambda: InProcessScorer.from_model(dtype=dtype), ScoreOptions(), resume=False,
                    progress="none")
        else:
            ray_job.run(source, out, ScoreOptions(), dtype=dtype, workers=2, progress="none")
        print(f"  {name:>10}: {time.perf_counter() - started:6.1f} s for the whole job (model loads included)",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--http-every", type=int, default=5, help="the HTTP arms score every n-th row of a round")
    ap.add_argument("--ray-rows", type=int, default=1000)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--ray", action="store_true", help="also the job on a local Ray with 2 workers")
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()

    from logprobe.datasets.columns import ScoreOptions
    from logprobe.datasets.scorer import InProcessScorer
    from logprobe.engine.runners import loader

    print(f"conditions: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads "
          f"{__import__('torch').get_num_threads()}, {args.dtype}, {args.rows} rows of {LENGTHS} words, "
          f"{args.rounds} rounds, HTTP arms on every {args.http_every}th row, load average "
          f"{os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d')}", flush=True)
    scorer = InProcessScorer.from_model(dtype=args.dtype, options=ScoreOptions())
    server = servers.start(["--dtype", args.dtype])
    every = max(1, args.http_every)
    arms = {"in-process": None, "loop": lambda t: request_loop(server.base, t[::every], 1),
            "8 clients": lambda t: request_loop(server.base, t[::every], 8)}
    model_dir = str(loader.ensure_cached(str(loader.bundled_gguf_path())))
    if not args.skip_transformers:
        arms["transformers"] = TransformersLoop(model_dir, args.dtype)
    blocks, head, hidden, inner = flops_per_token(model_dir)
    ceilings = {dtype: matmul_rate(dtype, 1024, hidden, inner) for dtype in ("float32", "bfloat16")}
    ceiling = ceilings[args.dtype] / (blocks + head)  # scored tokens a second at the bare product's rate
    print(f"matmul ceiling: {(blocks + head) / 1e6:.1f} MFLOP a scored token ({blocks / 1e6:.1f} blocks + "
          f"{head / 1e6:.1f} head); a bare [1024, {hidden}] x [{hidden}, {inner}] product runs "
          + ", ".join(f"{rate / 1e9:.0f} GFLOP/s at {dtype}" for dtype, rate in ceilings.items())
          + f": at most {ceiling:.0f} tok/s at {args.dtype}", flush=True)
    rates: dict[str, list[float]] = {name: [] for name in arms}
    rows_scored: list[tuple[int, int]] = []  # per round: the in-process job's scored tokens, and rows (BOSes)
    try:
        with tempfile.TemporaryDirectory(prefix="score-dataset-") as folder:
            for round_number in range(args.rounds):
                texts = make_rows(args.rows // args.rounds, salt=1000 + round_number)
                order = list(arms) if round_number % 2 == 0 else list(reversed(arms))
                for name in order:
                    run = arms[name] or (lambda t: in_process(scorer, t, folder))
                    tokens, wall = run(texts)
                    if name == "in-process":
                        tokens_of_round = tokens
                    rates[name].append(tokens / wall)
                    print(f"  round {round_number + 1} {name:>12}: {tokens} tokens in {wall:6.2f} s = "
                          f"{tokens / wall:8.1f} tok/s", flush=True)
                rows_scored.append((tokens_of_round, len(texts)))
            print("tokens/s (median of rounds) and the median per-round ratio to the in-process job:")
            for name, values in rates.items():
                ratios = [base / v for base, v in zip(rates["in-process"], values)]
                print(f"  {name:>12}: {statistics.median(values):8.1f} tok/s; in-process is "
                      f"{statistics.median(ratios):.2f}x this (rounds {', '.join(f'{r:.2f}' for r in ratios)}); "
                      f"{statistics.median(values) / ceiling:.0%} of the matmul ceiling")
            block_s, head_s = products_bound(model_dir, args.dtype)
            bound = statistics.median(tokens / (block_s * (tokens + rows) + head_s * tokens)
                                      for tokens, rows in rows_scored)
            print(f"products bound: {bound:.0f} tok/s (the blocks' products {block_s * 1e3:.3f} ms a token with "
                  f"every row's BOS, the head's {head_s * 1e3:.3f} ms a scored position, each at its shape's best "
                  f"bare rate; nothing else timed); the in-process job runs at "
                  f"{statistics.median(rates['in-process']) / bound:.0%} of it", flush=True)
            if "transformers" in rates:
                twice = 2 * statistics.median(rates["transformers"])
                print(f"  2x the transformers loop: {twice:.0f} tok/s = {twice / bound:.0%} of the products bound",
                      flush=True)
            if args.ray:
                server.terminate()
                scorer.close()
                ray_against_in_process(write_input(make_rows(args.ray_rows, salt=999), folder), folder, args.dtype)
    finally:
        server.terminate()
        scorer.close()


if __name__ == "__main__":
    main()
