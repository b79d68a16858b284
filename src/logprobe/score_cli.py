"""`logprobe score TEXT`: a text's per-token log probabilities as a table, JSON or a chart;
`logprobe score --input FILE`: a dataset's, into a file (datasets/).

In-process by default (loads the model, no server needed): the request goes through the API's pipeline
(api/serving/pipeline.py), the same checks and code as /v1/score, so the numbers are the API's. `--url` asks a
running server instead, through the one client of /v1/score (client/http.py).
"""

from __future__ import annotations

import asyncio
import math
import os
import sys

import orjson

from .config import install_hint


def score_in_process(args) -> dict:
    # torch and the model load for in-process scoring only (`--url` needs neither)
    from .config import Settings
    from .engine.engine import Engine
    from .engine.runners import loader

    source = loader.resolve_source(args.model)
    # built as `logprobe serve` and a dataset job build theirs
    engine = Engine.from_settings(Settings(model=args.model, dtype=args.dtype, device=args.device), source,
                                  source.aliases)
    engine.start()
    try:
        return answer_in_process(engine, args)
    finally:
        engine.stop()


def answer_in_process(engine, args) -> dict:
    """The /v1/score answer (its JSON as objects) to the command's text from a started engine of this
    process: a typed request through the API's pipeline (no hold: the CLI is the engine's only caller); a
    refusal exits with its message."""
    # the API's modules load for in-process scoring only
    from .api.errors import APIError, new_request_id
    from .api.registry import SCORE
    from .api.score import serving as scoring
    from .api.serving.holding import Call
    from .api.serving.pipeline import Pipeline
    from .config import Limits

    try:
        req = scoring.request(engine.info.name, input=args.text, context=args.context or None,
                              add_bos=not args.no_bos, top_logprobs=args.top or None)
        answer = asyncio.run(Pipeline(Limits(), backends=[engine]).answer_whole(SCORE, req, Call(new_request_id())))
        return answer.payload  # /v1/score's answer has no parts to splice in
    except APIError as exc:
        raise SystemExit(f"logprobe score: {exc.message}") from None


def score_remote(args) -> dict:
    from .client.http import ScoreClient, ServerError, run_sync  # the HTTP client loads with --url only

    async def ask():
        async with ScoreClient(args.url[0], args.api_key, args.model, timeout=600.0) as client:
            return await client.score(request_body(args))

    try:
        return run_sync(ask())
    except ServerError as exc:
        raise SystemExit(f"logprobe score: {exc.message}") from None


def request_body(args) -> dict:
    body = {"input": args.text, "add_bos": not args.no_bos}
    if args.context:
        body["context"] = args.context
    if args.top:
        body["top_logprobs"] = args.top
    return body


def table(item: dict) -> str:
    rows = [f"{'#':>3}  {'token':<18} {'logprob':>10} {'prob':>8} {'bits':>7} {'rank':>6}"]
    for i, (tok, lp, rank) in enumerate(zip(item["tokens"], item["token_logprobs"], item["token_ranks"])):
        shown = repr(tok)[1:-1][:18]
        if lp is None:
            rows.append(f"{i:>3}  {shown:<18} {'-':>10} {'-':>8} {'-':>7} {'-':>6}")
            continue
        rows.append(f"{i:>3}  {shown:<18} {lp:>10.4f} {math.exp(lp):>8.4f} {-lp / math.log(2):>7.2f} {rank:>6}")
    ppl = item["perplexity"]
    rows.append(f"sum logprob {item['logprob']:.4f}   mean {item['mean_logprob']:.4f}   "
                f"perplexity {ppl:.3f}   tokens {item['num_tokens']}" if ppl is not None else
                f"sum logprob {item['logprob']:.4f}   tokens {item['num_tokens']}")
    return "\n".join(rows)


def plot(item: dict, path: str) -> None:
    """Probability and log probability of each token (the chart of seed 003), saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    pairs = [(t, lp) for t, lp in zip(item["tokens"], item["token_logprobs"]) if lp is not None]
    tokens = [repr(t)[1:-1] for t, _ in pairs]
    log_probs = np.array([lp for _, lp in pairs])
    probs = np.exp(log_probs)
    x = np.arange(len(tokens))
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(tokens)), 6))
    ax.plot(x, probs, marker="o", linestyle="-", color="navy", label="Probability (exp(log(p)))")
    ax.plot(x, log_probs, marker="s", linestyle="--", color="darkgreen", label="Log Probability (log(p))")
    for i in x:
        ax.text(i, probs[i] + 0.01, f"p={probs[i]:.3f}", ha="center", va="bottom", fontsize=8, color="blue")
        ax.text(i, log_probs[i] - 0.1, f"log(p)={log_probs[i]:.2f}", ha="center", va="top", fontsize=8,
                color="green")
    ax.set_xticks(x, tokens, rotation=30)
    ax.set_title("Log Probabilities vs Probabilities of Tokens")
    ax.set_xlabel("Tokens")
    ax.set_ylabel("Value")
    ax.grid(True, linestyle="--", alpha=0.5)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def score_dataset(args) -> int:
    """`logprobe score --input FILE`: every row of a dataset, into --output (datasets/job.py)."""
    # the datasets' modules (pyarrow: the data extra) load with --input only
    from .datasets import job
    from .datasets.columns import ScoreOptions
    from .datasets.io import DatasetError, require_data_extra

    try:
        require_data_extra()
        if args.context:
            raise DatasetError("--context is for one TEXT; with --input, name a --context-column")
        if not 0 <= args.top <= 100:
            raise DatasetError(f"--top {args.top} is outside 0..100")
        options = ScoreOptions(top=args.top, tokens=args.tokens, stats=args.stats, add_bos=not args.no_bos,
                               skip_invalid=args.skip_invalid, asked=args.ids_column is not None)
        if not args.output and (os.path.isdir(args.input) or any(c in args.input for c in "*?[")):
            raise DatasetError(f"{args.input} names several files: give --output (a .parquet, .jsonl or .csv file)")
        output = args.output or args.input + ".scores.parquet"
        read_opts = job.ReadOptions(args.column, args.context_column, args.id_column, args.messages_column,
                                    args.ids_column)
        if args.ray and (args.messages_column or args.ids_column):
            raise DatasetError("--messages-column and --ids-column are not offered with --ray: score the file in "
                               "process or with --url")
        progress = "none" if args.quiet else "auto"
        if args.quiet:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # the weights' loading bar
        if args.ray:
            try:
                import ray.data  # noqa: F401
            except ImportError as exc:
                raise DatasetError(f"--ray scores on Ray Data, which is not installed ({exc.name}): "
                                   f"{install_hint('ray')}") from None
            from .datasets import ray_job  # Ray Data, an optional extra: with --ray only

            count = ray_job.run_from_args(args, output, options, read_opts, progress)
        else:
            count = job.run(args.input, output, lambda: _dataset_scorer(args, options), options, read_opts,
                            resume=args.resume, progress=progress, max_rows=max(1, args.chunk_rows))
        if args.plot or args.report:
            from .datasets import report  # the report's tables and charts load for --plot or --report only

            report.summarize_job(output, options, args.input, read_opts, args.plot, args.report, quiet=args.quiet)
    except DatasetError as exc:
        print(f"logprobe score: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("logprobe score: interrupted; the rows written so far are kept: run the same command again to "
              "go on", file=sys.stderr)
        return 130
    if not args.quiet:
        print(f"logprobe score: {count} rows written to {output}", file=sys.stderr)
    return 0


def _dataset_scorer(args, options):
    from .datasets.scorer import InProcessScorer, RemoteScorer  # the API's modules: with a dataset job only

    if args.url:
        return RemoteScorer(args.url, api_key=args.api_key, model=args.model, concurrency=args.concurrency,
                            options=options, batch_rows=args.batch_rows)
    return InProcessScorer.from_model(args.model, dtype=args.dtype, device=args.device, options=options)


def main(args) -> int:
    if args.input:
        if args.text is not None:
            print("logprobe score: give a TEXT or --input FILE, not both", file=sys.stderr)
            return 2
        return score_dataset(args)
    if args.text is None:
        print("logprobe score: give a TEXT to score, or --input FILE for a dataset", file=sys.stderr)
        return 2
    if args.url and len(args.url) > 1:
        print("logprobe score: one --url for a TEXT (several are for --input)", file=sys.stderr)
        return 2
    result = score_remote(args) if args.url else score_in_process(args)
    if args.json:
        sys.stdout.write(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        for item in result["data"]:
            print(table(item))
    if args.plot:
        plot(result["data"][0], args.plot)
        if not args.json:
            print(f"chart written to {args.plot}")
    return 0
