"""interventions and return_unmodified against a float64 forward of the same weights with the same
changes made by hooks: add, scale, zero, set and patch at chosen layers and positions (prompt and
generated), on both runners and on a family with sliding windows; a request's interventions never touch
another request of the same batch; the refusals."""

from __future__ import annotations

import asyncio
import base64
import copy

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from logprobe.api.app import create_app
from logprobe.backend import Intervention
from logprobe.config import Limits
from logprobe.engine.engine import Engine
from logprobe.engine.host.request import SamplingParams, SequenceGroup
from test_families import build

TOL = 2e-5


def b64(vector: np.ndarray) -> str:
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()


class Edited:
    """The float64 reference with a request's interventions applied by hooks (independent of the engine's
    code): `layer` 0 changes block 0's input, layer l block l's output."""

    def __init__(self, model):
        self.model = copy.deepcopy(model).to(torch.float64)
        self.decoder = self.model.model

    def stream(self, ids: list[int], layer: int) -> np.ndarray:
        """[len(ids), D] float64: the clean residual stream at `layer`."""
        with torch.inference_mode():
            out = self.model(torch.tensor([ids]), output_hidden_states=True)
            if layer < len(self.decoder.layers):
                return out.hidden_states[layer][0].numpy()
            got = {}
            h = self.decoder.layers[-1].register_forward_hook(lambda m, i, o: got.setdefault("x", o))
            self.model(torch.tensor([ids]))
            h.remove()
            x = got["x"][0] if isinstance(got["x"], tuple) else got["x"]
            return x[0].numpy()

    def logprobs(self, ids: list[int], edits: list[dict], prompt_len: int) -> np.ndarray:
        """[len(ids), V] float64 log probabilities of a pass over `ids` with `edits` (the API's objects)."""
        resolved = []
        for e in edits:
            positions = None if e.get("positions") is None else [p + prompt_len if p < 0 else p for p in e["positions"]]
            value = None
            if e["op"] in ("add", "set"):
                value = torch.tensor(np.asarray(e["vector"], dtype=np.float64))
            elif e["op"] == "patch":
                src = e["source"]["prompt"]
                row = self.stream(src, e["source"].get("layer", e["layer"]))[e["source"].get("position", -1)]
                value = torch.tensor(row)
            resolved.append((e["layer"], e["op"], positions, value, e.get("factor")))

        def change(layer, x):
            x = x.clone()
            for at, op, positions, value, factor in resolved:
                if at != layer:
                    continue
                rows = range(x.shape[1]) if positions is None else [p for p in positions if p < x.shape[1]]
                for p in rows:
                    if op == "add":
                        x[0, p] += value
                    elif op == "scale":
                        x[0, p] *= factor
                    elif op == "zero":
                        x[0, p] = 0
                    else:
                        x[0, p] = value
            return x

        handles = [self.decoder.layers[0].register_forward_pre_hook(
            lambda m, args, kwargs: ((change(0, args[0]), *args[1:]), kwargs) if args
            else (args, {**kwargs, "hidden_states": change(0, kwargs["hidden_states"])}), with_kwargs=True)]
        for i, block in enumerate(self.decoder.layers):
            handles.append(block.register_forward_hook(
                lambda m, inp, out, layer=i + 1: (change(layer, out[0]), *out[1:]) if isinstance(out, tuple)
                else change(layer, out)))
        try:
            with torch.inference_mode():
                logits = self.model(torch.tensor([ids])).logits[0]
        finally:
            for h in handles:
                h.remove()
        return torch.log_softmax(logits.double(), dim=-1).numpy()


def check_rows(logprobs, ids, ref, first=1):
    """Each token's log probability (from position `first` on) against the reference's row before it."""
    for i in range(first, len(ids)):
        assert abs(logprobs[i] - ref[i - 1, ids[i]]) < TOL, i


@pytest.fixture(scope="module")
def edited(tiny_model):
    return Edited(tiny_model)


@pytest.fixture(scope="module", params=["lean", "transformers"])
def runner_client(request, tiny_model, tokenizer):
    engine = Engine(tiny_model, tokenizer, "tiny", [], fast=request.param == "lean")
    engine.start()
    with TestClient(create_app(engine, Limits(max_interventions=4)), raise_server_exceptions=False) as c:
        yield c
    engine.stop()


def every_op(rng, d):
    return [
        {"layer": 1, "op": "add", "vector": rng.standard_normal(d).astype(np.float32).tolist(), "positions": [1, -1, 6]},
        {"layer": 0, "op": "scale", "factor": 1.7},
        {"layer": 2, "op": "zero", "positions": [2]},
        {"layer": 2, "op": "set", "vector": rng.standard_normal(d).astype(np.float32).tolist(), "positions": [3, 7]},
        {"layer": -2, "op": "patch", "source": {"prompt": [1, 400, 500, 600], "position": 2}, "positions": [0, 5]},
    ]


def test_every_op_at_prompt_and_generated_positions(runner_client, edited, tiny_model):
    rng = np.random.default_rng(0)
    ops = every_op(rng, tiny_model.config.hidden_size)
    for chunk in (ops[:4], ops[4:]):  # within the cap of 4
        body = {"model": "tiny", "prompt": [1, 50, 60, 70, 80], "max_tokens": 4, "temperature": 0, "echo": True,
                "logprobs": 3, "interventions": [{**e, "vector": b64(e["vector"])} if "vector" in e else e
                                                 for e in chunk], "return_unmodified": True}
        r = runner_client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        ids = choice["unmodified"]["token_ids"]
        assert len(ids) == 5 + 4
        wire = [dict(e, layer=e["layer"] % 3) for e in chunk]  # 2 blocks: layers 0..2
        ref = edited.logprobs(ids, wire, 5)
        check_rows(choice["logprobs"]["token_logprobs"], ids, ref)
        # the greedy tokens are the reference's argmax under the same interventions (or tied with it)
        for i in range(5, len(ids)):
            assert ref[i - 1, ids[i]] > ref[i - 1].max() - TOL
        top = choice["logprobs"]["top_logprobs"][3]
        for token, lp in top.items():  # a prompt position's top-k under the interventions
            tid = runner_client.post("/tokenize", json={"model": "tiny", "prompt": token,
                                                        "add_special_tokens": False}).json()["tokens"]
            if len(tid) == 1:
                assert abs(lp - ref[2, tid[0]]) < TOL
        clean = edited.logprobs(ids, [], 5)
        un = choice["unmodified"]
        check_rows(un["logprobs"], ids, clean)
        np.testing.assert_allclose(un["top_logprobs"][4], np.sort(clean[3])[::-1][:3], atol=TOL)
        assert un["ranks"][1] == int((clean[0] > clean[0, ids[1]]).sum()) + 1
        # the interventions changed something, or the test would prove nothing
        assert max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"][1:], un["logprobs"][1:])) > 1e-3


def test_set_is_exact_in_the_residual_stream(runner_client, tiny_model):
    d = tiny_model.config.hidden_size
    vector = np.linspace(-2, 2, d).astype(np.float32)
    r = runner_client.post("/v1/completions", json={
        "model": "tiny", "prompt": [1, 9, 8, 7], "max_tokens": 3, "temperature": 0,
        "interventions": [{"layer": 1, "op": "set", "vector": b64(vector), "positions": [1, 5]}],
        "output_residual_stream": {"layers": [1], "encoding": "json"}})
    stream = np.asarray(r.json()["choices"][0]["residual_stream"]["data"]["1"], dtype=np.float32)
    assert stream.shape == (7, d)
    np.testing.assert_array_equal(stream[1], vector)
    np.testing.assert_array_equal(stream[5], vector)  # a generated token's position
    assert not np.array_equal(stream[2], vector)


def test_patching_a_prompt_with_itself_changes_nothing(runner_client):
    prompt = [1, 30, 31, 32, 33, 34]
    base = {"model": "tiny", "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0}
    plain = runner_client.post("/v1/completions", json=base).json()["choices"][0]["logprobs"]["token_logprobs"]
    patched = runner_client.post("/v1/completions", json={**base, "interventions": [
        {"layer": 1, "op": "patch", "source": {"prompt": prompt, "position": 3}, "positions": [3]}]}).json()
    np.testing.assert_allclose(patched["choices"][0]["logprobs"]["token_logprobs"][1:], plain[1:], atol=1e-6)


def test_sliding_window_family(tokenizer):
    model = build("gemma3", len(tokenizer))
    ref = Edited(model)
    engine = Engine(model, tokenizer, "g", [], fast=True)
    engine.start()
    try:
        rng = np.random.default_rng(1)
        d = model.config.hidden_size
        ids = [2] + list(range(300, 330))  # longer than the window
        edits = [{"layer": 2, "op": "add", "vector": rng.standard_normal(d).astype(np.float32).tolist(),
                  "positions": [3, 20, 32]},
                 {"layer": 4, "op": "scale", "factor": 0.5, "positions": [-1]}]
        params = SamplingParams(max_tokens=3, temperature=0, echo=True, logprobs=0,
                                interventions=tuple(Intervention(e["layer"], e["op"], tuple(e["positions"]),
                                                                 np.asarray(e.get("vector", np.zeros(0)), np.float32)
                                                                 if "vector" in e else None, e.get("factor", 1.0))
                                                    for e in edits))
        g = SequenceGroup("g", ids, params, engine.table)
        asyncio.run(engine.run_groups([g]))
    finally:
        engine.stop()
    seq = g.sequences[0]
    full = ids + seq.token_ids
    expect = ref.logprobs(full, edits, len(ids))
    check_rows(np.r_[g.prompt_columns.logprobs, seq.logprobs], full, expect)


def run_batch(engine, groups):
    asyncio.run(engine.run_groups(groups))
    return groups


def test_another_request_of_the_batch_is_untouched(tiny_model, tokenizer):
    """The same batches with and without one request's interventions: every other request's numbers are
    identical to the bit, in a prompt-only batch (one padded pass) and in generation (prefill packed
    into one pass, decode steps batched)."""
    engine = Engine(tiny_model, tokenizer, "tiny", [], fast=True)
    engine.start()
    d = tiny_model.config.hidden_size
    push = Intervention(1, "add", None, np.full(d, 3.0, np.float32))
    try:
        for max_tokens in (0, 6):
            def groups(edit: bool):
                common = dict(max_tokens=max_tokens, echo=True, logprobs=2, prompt_logprobs=2, seed=3)
                out = []
                for i, prompt in enumerate(([1, 5, 6, 7], [1, 5, 6, 7, 8, 9], [1, 40, 41])):
                    params = SamplingParams(**common, interventions=(push,) if edit and i == 1 else ())
                    out.append(SequenceGroup(f"r{i}", list(prompt), params, engine.table))
                return out

            before = run_batch(engine, groups(False))
            after = run_batch(engine, groups(True))
            for i in (0, 2):
                a, b = before[i], after[i]
                np.testing.assert_array_equal(a.prompt_columns.logprobs, b.prompt_columns.logprobs)
                np.testing.assert_array_equal(a.prompt_columns.top_logprobs, b.prompt_columns.top_logprobs)
                assert a.sequences[0].token_ids == b.sequences[0].token_ids
                np.testing.assert_array_equal(a.sequences[0].logprobs, b.sequences[0].logprobs)
            changed = np.nanmax(np.abs(before[1].prompt_columns.logprobs - after[1].prompt_columns.logprobs))
            assert changed > 1e-2
    finally:
        engine.stop()


def test_a_plain_request_after_an_edited_one_is_unchanged(client):
    body = {"model": "tiny", "prompt": "Later requests", "max_tokens": 5, "seed": 9, "logprobs": 2, "echo": True}
    first = client.post("/v1/completions", json=body).json()["choices"][0]
    edited = client.post("/v1/completions", json={**body, "interventions": [
        {"layer": 0, "op": "scale", "factor": 3.0}], "stream": False}).json()["choices"][0]
    again = client.post("/v1/completions", json=body).json()["choices"][0]
    assert edited["logprobs"] != first["logprobs"]
    assert again == first


def test_streamed_interventions_match(client):
    body = {"model": "tiny", "prompt": "Stream it", "max_tokens": 5, "temperature": 0, "logprobs": 1,
            "interventions": [{"layer": 1, "op": "scale", "factor": -1.0}]}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    import json

    streamed = []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for c in chunk["choices"]:
                    streamed += c["logprobs"]["token_logprobs"] if c.get("logprobs") else []
    assert streamed == whole["logprobs"]["token_logprobs"]


def test_chat_takes_interventions(client):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    out = client.post("/v1/chat/completions", json={**body, "return_unmodified": True, "interventions": [
        {"layer": 2, "op": "zero", "positions": [-1]}]}).json()["choices"][0]
    un = out["unmodified"]
    assert len(un["token_ids"]) == len(un["logprobs"]) and len(un["top_logprobs"][1]) == 2
    generated = [e["logprob"] for e in out["logprobs"]["content"]]
    assert generated[0] != pytest.approx(un["logprobs"][-3], abs=1e-4)  # the first token follows the zeroed position


@pytest.mark.parametrize("extra,param,needle", [
    ({"interventions": 3}, "interventions", "an array of objects"),
    ({"interventions": [{"layer": 1, "op": "add"}]}, "interventions[0].vector", "needs it"),
    ({"interventions": [{"layer": 1, "op": "grow"}]}, "interventions[0].op", "one of add"),
    ({"interventions": [{"layer": 9, "op": "zero"}]}, "interventions[0].layer", "layer 9 does not exist"),
    ({"interventions": [{"layer": "1", "op": "zero"}]}, "interventions[0].layer", "an integer"),
    ({"interventions": [{"layer": 1, "op": "add", "vector": [1.0, 2.0]}]}, "interventions[0].vector", "d_model = 64"),
    ({"interventions": [{"layer": 1, "op": "add", "vector": "@@"}]}, "interventions[0].vector", "base64"),
    ({"interventions": [{"layer": 1, "op": "add", "vector": [1e39] * 64}]}, "interventions[0].vector", "float32"),
    ({"interventions": [{"layer": 1, "op": "scale", "factor": 2, "vector": [1.0]}]}, "interventions[0].vector",
     "does not go with"),
    ({"interventions": [{"layer": 1, "op": "zero", "positions": [40]}]}, "interventions[0].positions", "outside"),
    ({"interventions": [{"layer": 1, "op": "zero", "positions": [-4]}]}, "interventions[0].positions", "outside"),
    ({"interventions": [{"layer": 1, "op": "zero", "positions": []}]}, "interventions[0].positions", "non-empty"),
    ({"interventions": [{"layer": 1, "op": "zero", "when": 1}]}, "interventions[0].when", "Unrecognized"),
    ({"interventions": [{"layer": 1, "op": "patch", "source": {"prompt": [1, 2], "position": 2}}]},
     "interventions[0].source.position", "has 2 tokens"),
    ({"interventions": [{"layer": 1, "op": "patch", "source": {"prompt": [10 ** 6]}}]},
     "interventions[0].source.prompt", "outside the vocabulary"),
    ({"interventions": [{"layer": 1, "op": "patch", "source": "text"}]}, "interventions[0].source", "an object"),
    ({"interventions": [{"layer": 0, "op": "zero"}] * 17}, "interventions", "at most 16"),
    ({"return_unmodified": True}, "return_unmodified", "needs 'interventions'"),
    ({"return_unmodified": True, "stream": True, "interventions": [{"layer": 0, "op": "zero"}]}, "return_unmodified",
     "stream"),
])
def test_refusals(client, extra, param, needle):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, **extra})
    err = r.json()["error"]
    assert r.status_code == 400 and needle in err["message"], err
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_cap_in_the_model_card(runner_client):
    assert runner_client.get("/v1/models/tiny").json()["limits"]["max_interventions"] == 4


def test_a_context_shared_in_the_batch_and_an_intervened_prompt(tiny_model, tokenizer, edited):
    """Prompt-only prompts of one batch that share a 20-token context share its pass, and those in the
    prefix cache reuse it; the one with interventions runs whole under them, before and after the cache
    holds the context. Every row against the float64 reference, with or without the interventions."""
    engine = Engine(tiny_model, tokenizer, "tiny", [], fast=True)
    engine.start()
    d = tiny_model.config.hidden_size
    vector = np.random.default_rng(2).standard_normal(d).astype(np.float32)
    wire = [{"layer": 1, "op": "add", "vector": vector, "positions": [4, 21]}]
    push = Intervention(1, "add", (4, 21), vector)
    context = [1] + list(range(200, 219))
    prompts = [context + [7, 8], context + [9, 10], context + [11]]
    try:
        for _ in range(2):  # the second time, the context is in the prefix cache
            groups = [SequenceGroup(f"r{i}", list(p), SamplingParams(
                max_tokens=0, echo=True, logprobs=1, interventions=(push,) if i == 1 else ()), engine.table)
                for i, p in enumerate(prompts)]
            run_batch(engine, groups)
            for i, g in enumerate(groups):
                ref = edited.logprobs(g.prompt_ids, wire if i == 1 else [], len(g.prompt_ids))
                check_rows(g.prompt_columns.logprobs, g.prompt_ids, ref)
    finally:
        engine.stop()


def test_a_patch_that_fails_fails_its_request_only(tiny_model, tokenizer, monkeypatch):
    """A failure while resolving a request's interventions (its patch source's pass) fails that request
    with the error envelope; a plain request beside it and every later request, intervened or not, are
    answered as before."""
    engine = Engine(tiny_model, tokenizer, "tiny", [], fast=True)
    engine.start()
    try:
        with TestClient(create_app(engine, Limits()), raise_server_exceptions=False) as c:
            plain = {"model": "tiny", "prompt": [1, 3, 5, 7], "max_tokens": 3, "temperature": 0, "logprobs": 1}
            patch = {**plain, "interventions": [{"layer": 1, "op": "patch", "source": {"prompt": [1, 2]}}]}
            before = c.post("/v1/completions", json=plain).json()["choices"][0]
            good = c.post("/v1/completions", json=patch).json()["choices"][0]
            real = engine.runner.residual_stream

            def broken(ids, layers, edits=None):
                if edits is None and list(ids) == [1, 2]:
                    raise RuntimeError("source pass failed")
                return real(ids, layers, edits)

            monkeypatch.setattr(engine.runner, "residual_stream", broken)
            failed = c.post("/v1/completions", json=patch)
            assert failed.status_code == 500 and failed.json()["error"]["type"]
            assert "source pass failed" not in failed.text  # no internals leak
            monkeypatch.setattr(engine.runner, "residual_stream", real)
            assert c.post("/v1/completions", json=plain).json()["choices"][0] == before
            assert c.post("/v1/completions", json=patch).json()["choices"][0] == good
            assert engine.stats()["failing"] is False
    finally:
        engine.stop()


@pytest.mark.parametrize("path,extra", [
    ("/v1/completions", {"prompt": "The sky is", "max_tokens": 0}),
    ("/v1/completions", {"prompt": "The sky is", "max_tokens": 0, "logprobs": 1}),
    ("/v1/completions", {"prompt": "The sky is", "max_tokens": 0, "echo": True}),
    ("/v1/completions", {"prompt": "The sky is", "max_tokens": 2, "temperature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0})])
def test_unmodified_comes_back_when_nothing_else_asks_for_prompt_log_probabilities(client, reference, tokenizer,
                                                                                   path, extra):
    """`return_unmodified` alone (no prompt_logprobs, no echo with logprobs): every position's log
    probability without the interventions, against the float64 forward, for prompt-only requests too."""
    body = {"model": "tiny", **extra, "return_unmodified": True,
            "interventions": [{"layer": 1, "op": "scale", "factor": 2.0}]}
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    un = r.json()["choices"][0]["unmodified"]
    ids = un["token_ids"]
    assert len(ids) >= 2 and un["logprobs"][0] is None and len(un["logprobs"]) == len(ids)
    ref = reference.logprobs(ids)
    for i in range(1, len(ids)):
        assert abs(un["logprobs"][i] - float(ref[i - 1, ids[i]])) < TOL, i
        assert un["ranks"][i] == int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1
