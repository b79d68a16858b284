"""POST /v1/tree against the float64 reference: every node's numbers at its own prefix, on the lean
runner (tree attention over kept keys and values) and on transformers' forward (paths recomputed), and
the tree against the single-step requests a client would send to build it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from logprobe.api.app import create_app
from logprobe.config import Limits

TOL = 1e-5
PROMPT = [5, 17, 300, 4242]


@pytest.fixture(scope="module")
def fallback_client(tiny_model, tokenizer):
    """The same weights on transformers' forward (the runner for models no lean family claims)."""
    from logprobe.engine.engine import Engine

    engine = Engine(tiny_model, tokenizer, "test/tiny-llama", ["tiny"], fast=False)
    engine.start()
    with TestClient(create_app(engine, Limits()), raise_server_exceptions=False) as c:
        yield c
    engine.stop()


@pytest.fixture(params=["lean", "transformers"])
def any_client(request, client, fallback_client):
    return client if request.param == "lean" else fallback_client


def tree_of(client, **body) -> dict:
    body.setdefault("model", "tiny")
    r = client.post("/v1/tree", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def path_of(nodes: list[dict], index: int) -> list[int]:
    path = []
    while index is not None:
        path.append(nodes[index]["token_id"])
        index = nodes[index]["parent"]
    return path[::-1]


def processed_reference(row: torch.Tensor, temperature: float, top_k: int = -1, top_p: float = 1.0) -> np.ndarray:
    """The distribution a token is drawn from, in float64, written out: temperature, then the top-k and
    top-p filters (a token is kept while the mass before it is short of p), renormalised."""
    scores = row / temperature
    if 0 < top_k < len(row):
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        probs = torch.softmax(scores, -1)
        order = torch.argsort(probs, descending=True)
        before = torch.cumsum(probs[order], 0) - probs[order]
        drop = order[before >= top_p]
        scores[drop] = float("-inf")
    return torch.log_softmax(scores, -1).numpy()


def check_against_reference(tree: dict, reference, temperature: float, top_k: int = -1, top_p: float = 1.0,
                            branches: int = 5, branch_p: float | None = None) -> None:
    nodes = tree["nodes"]
    by_parent: dict = {}
    for node in nodes:
        by_parent.setdefault(node["parent"], []).append(node)
    assert tree["roots"] == [n["index"] for n in by_parent[None]]
    for parent, children in by_parent.items():
        prefix = tree["prompt_token_ids"] + (path_of(nodes, parent) if parent is not None else [])
        raw = reference.logprobs(prefix)[-1]
        processed = processed_reference(raw.clone(), temperature, top_k, top_p)
        raw = raw.numpy()
        entropy = float(-(np.exp(raw) * raw).sum())
        # the children: the likeliest of the processed distribution, the likeliest first
        ids = [c["token_id"] for c in children]
        order = np.argsort(-processed, kind="stable")
        count = min(branches, int(np.isfinite(processed).sum()))
        if branch_p is not None:
            probs = np.exp(processed[order[:count]])
            count = int(((np.cumsum(probs) - probs) < branch_p - 1e-6).sum())
        assert len(ids) == count, (parent, ids, count)
        kth = processed[order[count - 1]]
        assert all(processed[t] >= kth - TOL for t in ids)
        values = [processed[t] for t in ids]
        assert all(a >= b - TOL for a, b in zip(values, values[1:]))
        for child in children:
            t = child["token_id"]
            assert child["depth"] == len(prefix) - len(tree["prompt_token_ids"]) + 1
            assert abs(child["logprob"] - raw[t]) < TOL
            assert abs(child["processed_logprob"] - processed[t]) < TOL
            parent_cumulative = nodes[parent]["cumulative_logprob"] if parent is not None else 0.0
            assert abs(child["cumulative_logprob"] - (parent_cumulative + raw[t])) < TOL
            low, high = reference.rank_bounds(raw, t)
            assert low <= child["rank"] <= high
            assert abs(child["entropy"] - entropy) < TOL * (1 + entropy)  # each log p within TOL moves H by TOL (1 + H) at most
            if parent is not None:
                assert child["index"] in nodes[parent]["children"]


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_k=3),
                                      dict(temperature=1.3, top_p=0.002)])
def test_every_node_matches_reference(any_client, reference, settings):
    tree = tree_of(any_client, prompt=PROMPT, depth=3, branches=4, **settings)
    nodes = tree["nodes"]
    top_k = settings.get("top_k", -1)
    if top_k == -1 and "top_p" not in settings:
        assert len(nodes) == 4 + 16 + 64
    check_against_reference(tree, reference, settings["temperature"], top_k, settings.get("top_p", 1.0), 4)
    assert tree["usage"]["completion_tokens"] == len(nodes)
    inner = sum(1 for n in nodes if n["children"])
    assert tree["usage"]["forward_tokens"] == len(PROMPT) + inner  # the prompt once, each expanded node once


def test_branch_p_and_greedy(any_client, reference):
    tree = tree_of(any_client, prompt=PROMPT, depth=2, branches=20, branch_p=0.004, temperature=0.5)
    check_against_reference(tree, reference, 0.5, branches=20, branch_p=0.004)
    counts = {len(n["children"]) for n in tree["nodes"] if n["depth"] == 1}
    assert max(counts) < 20  # the cut, not the cap, decided
    greedy = tree_of(any_client, prompt=PROMPT, depth=3, branches=5, temperature=0)
    assert [n["depth"] for n in greedy["nodes"]] == [1, 2, 3]  # a point mass: one child each
    assert [n["processed_logprob"] for n in greedy["nodes"]] == [0.0, 0.0, 0.0]
    assert [n["rank"] for n in greedy["nodes"]] == [1, 1, 1]


def test_text_prompt_and_offsets(client, tiny_engine):
    tree = tree_of(client, prompt="The sky is", depth=2, branches=3)
    assert tree["prompt_token_ids"] == tiny_engine.tokenizer("The sky is").input_ids
    table = tiny_engine.table
    for node in tree["nodes"]:
        path = path_of(tree["nodes"], node["index"])
        assert node["text"] == tiny_engine.tokenizer.decode(path)
        assert node["token"] == table.strings[node["token_id"]]
        assert bytes(node["bytes"]) == table.token_bytes[node["token_id"]]
        assert node["text"][node["text_offset"]:].startswith(node["token"])


def test_tree_equals_the_single_step_requests(client):
    """A depth-3 top-5 tree (155 nodes) holds what the 31 requests `max_tokens: 1, logprobs: 5` (one per
    inner node, the prompt's included) return: each node's children are its request's five likeliest
    tokens with the same log probabilities."""
    tree = tree_of(client, prompt=PROMPT, depth=3, branches=5)
    nodes = tree["nodes"]
    assert len(nodes) == 155
    inner = [None] + [n["index"] for n in nodes if n["depth"] < 3]
    assert len(inner) == 31
    for parent in inner:
        prefix = PROMPT + (path_of(nodes, parent) if parent is not None else [])
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": prefix, "max_tokens": 1, "logprobs": 5,
                                                 "return_tokens_as_token_ids": True})
        assert r.status_code == 200, r.text
        top = r.json()["choices"][0]["logprobs"]["top_logprobs"][0]
        five = dict(sorted(((int(k.split(":")[1]), v) for k, v in top.items()), key=lambda kv: -kv[1])[:5])
        children = nodes[parent]["children"] if parent is not None else tree["roots"]
        mine = {nodes[c]["token_id"]: nodes[c]["logprob"] for c in children}
        assert set(mine) == set(five), (parent, mine, five)
        for token, value in mine.items():
            assert abs(value - five[token]) < TOL


def test_steered_tree(any_client, reference):
    """allowed_token_ids and logit_bias shape the processed distribution and the children (never the raw
    numbers): processed is the reference renormalised over the allowed tokens after the bias."""
    allowed = [7, 11, 300, 999, 4242, 12000]
    tree = tree_of(any_client, prompt=PROMPT, depth=2, branches=3, allowed_token_ids=allowed,
                   logit_bias={"11": 3.0, "999": -100})
    nodes = tree["nodes"]
    assert len(nodes) == 3 + 9
    for node in nodes:
        path = path_of(nodes, node["index"])
        raw = reference.logprobs(PROMPT + path[:-1])[-1]
        scores = torch.full_like(raw, float("-inf"))
        scores[allowed] = raw[allowed]
        scores[11] += 3.0
        scores[999] -= 100.0
        processed = torch.log_softmax(scores, -1).numpy()
        token = node["token_id"]
        assert token in allowed and token != 999
        assert abs(node["logprob"] - raw[token].item()) < TOL
        assert abs(node["processed_logprob"] - processed[token]) < TOL


def test_constrained_tree_against_an_independent_allowed_set(client, tiny_engine, reference):
    """Under `structured_outputs.regex` `[0-9]{1,3}`, each node's children are digits while fewer than
    three are spelled, or a stop token once one is, and processed is the reference renormalised over
    that set; the set is computed here from the tokens' bytes, not by the grammar."""
    table, stops = tiny_engine.table, sorted(tiny_engine.info.stop_token_ids)
    spelled = [table.text_bytes(t) for t in range(tiny_engine.info.vocab_size)]
    digits = [t for t, piece in enumerate(spelled) if piece.isdigit()]

    def allowed(text: bytes) -> list[int]:
        return (digits if len(text) < 3 else []) + (stops if text else [])

    tree = tree_of(client, prompt=PROMPT, depth=4, branches=4, temperature=0.8,
                   structured_outputs={"regex": "[0-9]{1,3}"})
    nodes = tree["nodes"]
    assert max(n["depth"] for n in nodes) == 4  # three digits, then the end
    for parent in {None} | {n["parent"] for n in nodes}:
        path = path_of(nodes, parent) if parent is not None else []
        raw = reference.logprobs(PROMPT + path)[-1]
        ok = allowed(b"".join(spelled[t] for t in path))
        scores = torch.full_like(raw, float("-inf"))
        scores[ok] = raw[ok] / 0.8
        processed = torch.log_softmax(scores, -1).numpy()
        children = [n for n in nodes if n["parent"] == parent]
        assert len(children) == min(4, len(ok))
        kth = np.sort(processed[ok])[::-1][len(children) - 1]
        for child in children:
            assert child["token_id"] in ok
            assert processed[child["token_id"]] >= kth - TOL
            assert abs(child["processed_logprob"] - processed[child["token_id"]]) < TOL
            assert abs(child["logprob"] - raw[child["token_id"]].item()) < TOL
            assert child["is_stop"] == (child["token_id"] in stops)


@pytest.mark.parametrize("kind", ["gemma3", "qwen2"])
def test_sliding_windows_cut_the_tree_mask(kind, tokenizer, reference_of):
    """A family with sliding windows (Gemma 3: every other layer, its logits softcapped; Qwen2: layers
    past the first) on the lean runner: the tree's nodes sit past the window of a prompt longer than it,
    so the tree mask must drop what the window drops, by position."""
    from logprobe.engine.engine import Engine
    from test_families import WINDOW, build

    model = build(kind, len(tokenizer))
    engine = Engine(model, tokenizer, "m", ["tiny"])
    assert engine.info.runner == "lean" and engine.runner.attention.window_sizes == [WINDOW]
    engine.start()
    try:
        with TestClient(create_app(engine, Limits())) as c:
            prompt = list(range(200, 200 + WINDOW + 3))
            tree = tree_of(c, prompt=prompt, depth=3, branches=3, temperature=0.9)
        check_against_reference(tree, reference_of(model), 0.9, branches=3)
    finally:
        engine.stop()


def test_a_failing_tree_fails_alone(client, tiny_engine, monkeypatch):
    """A tree whose pass raises fails that request (500), the engine goes on serving, and the next tree
    is whole."""
    def broken(tree, hit):
        raise RuntimeError("injected")

    monkeypatch.setattr(tiny_engine.runner, "tree_pass", broken)
    r = client.post("/v1/tree", json={"model": "tiny", "prompt": PROMPT, "depth": 2, "branches": 2})
    assert r.status_code == 500, r.text
    monkeypatch.undo()
    assert len(tree_of(client, prompt=PROMPT, depth=2, branches=2)["nodes"]) == 6
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200, r.text
