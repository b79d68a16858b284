"""A token tree (docs/performance.md, "Token trees"): the depth-3 top-5 tree below a prompt (155 nodes), as
one POST /v1/tree against the 31 requests a client sends to build it without one (`max_tokens: 1`,
`logprobs: 5`, one per inner node: the prompt, then each of its 5 children, then each of their 25).

Measured in one process on the bundled model through the HTTP application (in-process transport, no
sockets), in alternating rounds. The client's requests go level by level, each level's requests at once
(the engine batches them: the best such a client can do), and one at a time. The tree's numbers are
checked against the requests' (the same children, the largest difference of a log probability printed).

    python benchmarks/token_tree.py [--prompt-tokens 128] [--rounds 5] [--depth 3] [--branches 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import httpx
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from logprobe.api.app import create_app  # noqa: E402
from logprobe.config import Limits  # noqa: E402
from logprobe.engine.runners import loader  # noqa: E402
from logprobe.engine.engine import Engine  # noqa: E402

MODEL = "smollm2-135m"
TEXT = ("The lighthouse keeper wrote in his log every evening, whatever the weather. Most entries were short: "
        "the wind, the ships that passed, the oil he used. But on the night of the great storm he wrote three "
        "pages, and the last line, underlined twice, was the one the village still repeats. ")


def prompt_ids(tokenizer, count: int) -> list[int]:
    ids = tokenizer(TEXT * (1 + count // 40)).input_ids
    return ids[:count]


async def as_tree(client, prompt: list[int], depth: int, branches: int) -> dict:
    """{path (tuple of ids): {child id: log probability}} from one /v1/tree request."""
    r = await client.post("/v1/tree", json={"model": MODEL, "prompt": prompt, "depth": depth, "branches": branches})
    r.raise_for_status()
    nodes, out = r.json()["nodes"], {}
    paths = {}
    for node in nodes:
        parent = node["parent"]
        path = () if parent is None else paths[parent]
        paths[node["index"]] = path + (node["token_id"],)
        out.setdefault(path, {})[node["token_id"]] = node["logprob"]
    return out


async def one_step(client, prompt: list[int], path: tuple, branches: int) -> dict:
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt + list(path), "max_tokens": 1,
                                                   "logprobs": branches, "temperature": 0,
                                                   "return_tokens_as_token_ids": True})
    r.raise_for_status()
    top = r.json()["choices"][0]["logprobs"]["top_logprobs"][0]
    ranked = sorted(((int(k.split(":")[1]), v) for k, v in top.items()), key=lambda kv: -kv[1])[:branches]
    return dict(ranked)


async def as_requests(client, prompt: list[int], depth: int, branches: int, at_once: bool) -> dict:
    """The same tree from single-step requests, level by level (each level's requests together or one by one)."""
    out, level = {}, [()]
    for _ in range(depth):
        if at_once:
            answers = await asyncio.gather(*(one_step(client, prompt, path, branches) for path in level))
        else:
            answers = [await one_step(client, prompt, path, branches) for path in level]
        out.update(zip(level, answers))
        level = [path + (token,) for path, children in zip(level, answers) for token in children]
    return {path: children for path, children in out.items()}


def largest_difference(tree: dict, requests: dict) -> float:
    worst = 0.0
    for path, children in requests.items():
        if path not in tree:  # a leaf of the tree (depth reached): its requests' children are not in the tree
            continue
        if set(tree[path]) != set(children):
            raise SystemExit(f"different children after {path}: {sorted(tree[path])} vs {sorted(children)}")
        worst = max(worst, *(abs(tree[path][t] - children[t]) for t in children))
    return worst


async def measure(app, prompt: list[int], args) -> None:
    arms = {"tree": lambda c: as_tree(c, prompt, args.depth, args.branches),
            "requests, each level at once": lambda c: as_requests(c, prompt, args.depth, args.branches, True),
            "requests, one at a time": lambda c: as_requests(c, prompt, args.depth, args.branches, False)}
    times = {name: [] for name in arms}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
        answers = {name: await arm(client) for name, arm in arms.items()}  # warm-up, and the numbers compared
        for _ in range(args.rounds):
            for name, arm in arms.items():
                t0 = time.perf_counter()
                await arm(client)
                times[name].append(time.perf_counter() - t0)
    nodes = sum(len(children) for children in answers["tree"].values())
    inner = sum(1 for path in answers["requests, one at a time"])
    print(f"bundled model ({MODEL}), prompt of {len(prompt)} tokens, depth {args.depth}, {args.branches} branches: "
          f"{nodes} nodes, {inner} single-step requests; {torch.get_num_threads()} torch threads, {args.rounds} "
          "alternating rounds (median)")
    print("| | seconds | x the tree |")
    print("| --- | --- | --- |")
    base = statistics.median(times["tree"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.3f} | {median / base:.2f} |")
    worst = max(largest_difference(answers["tree"], answers[name]) for name in arms if name != "tree")
    print(f"same children everywhere; largest difference of a log probability: {worst:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--branches", type=int, default=5)
    args = parser.parse_args()
    model, tokenizer = loader.load(loader.resolve_source(None))
    engine = Engine(model, tokenizer, MODEL, [])
    engine.start()
    try:
        asyncio.run(measure(create_app(engine, Limits()), prompt_ids(tokenizer, args.prompt_tokens), args))
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
