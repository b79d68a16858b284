"""`logprobe score TEXT`: a text's per-token log probabilities as a table, JSON or a chart.

In-process by default (loads the model, no server needed); `--url` asks a running server instead.
Both go through the same /v1/score code, so the numbers are the API's.
"""

from __future__ import annotations

import asyncio
import math
import sys

import orjson


def score_in_process(args) -> dict:
    from .api import scoring
    from .api.errors import APIError
    from .config import Limits
    from .engine import loader
    from .engine.engine import Engine

    source = loader.resolve_source(args.model)
    model, tokenizer = loader.load(source, dtype=args.dtype, device=args.device)
    engine = Engine(model, tokenizer, source.name, source.aliases)
    engine.start()
    try:
        body = request_body(args)
        body["model"] = engine.info.name
        limits = Limits()
        try:
            req = scoring.parse_score(body, limits)
            items = scoring.tokenize_items(engine, req)
            scoring.check_caps(engine, req, items, limits)
        except APIError as exc:
            raise SystemExit(f"logprobe score: {exc.message}") from None
        outputs = asyncio.run(engine.run(scoring.build_requests(engine, req, items, "cli")))
        return scoring.format_response(engine, req, items, outputs)
    finally:
        engine.stop()


def score_remote(args) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    body = request_body(args)
    body["model"] = args.model or "smollm2-135m"
    r = httpx.post(args.url.rstrip("/") + "/v1/score", json=body, headers=headers, timeout=600)
    if r.status_code != 200:
        raise SystemExit(f"logprobe score: the server answered {r.status_code}: {r.text[:300]}")
    return r.json()


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


def main(args) -> int:
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
