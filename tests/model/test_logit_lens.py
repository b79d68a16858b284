"""output_lens (the logit lens) against a float64 forward of the same weights: each asked layer's residual
stream through the final norm and the head, at every prompt and generated position, on both runners."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from logprobe.api.app import create_app
from logprobe.config import Limits
from logprobe.engine.engine import Engine
from logprobe.engine.host.request import SamplingParams, SequenceGroup

TOL = 2e-5


def lens64(reference, ids: list[int], layer: int, num_layers: int) -> np.ndarray:
    """[len(ids), V] float64 log probabilities of layer `layer` read through the final norm and the head."""
    model = reference.model
    with torch.inference_mode():
        out = model(torch.tensor([ids]), output_hidden_states=True)
        if layer < num_layers:
            hidden = out.hidden_states[layer][0]
        else:  # hidden_states[L] is already normed: take the last block's output by a hook
            captured = {}
            handle = model.model.layers[-1].register_forward_hook(lambda m, i, o: captured.setdefault("h", o))
            model(torch.tensor([ids]))
            handle.remove()
            hidden = (captured["h"][0] if isinstance(captured["h"], tuple) else captured["h"])[0]
        logits = model.lm_head(model.model.norm(hidden))
    return torch.log_softmax(logits.double(), dim=-1).numpy()


def check_layer(entry, ids, ref, k):
    assert entry["logprobs"][0] is None and entry["ranks"][0] is None
    for i in range(1, len(ids)):
        row = ref[i - 1]
        assert abs(entry["logprobs"][i] - row[ids[i]]) < TOL
        lo, hi = int((row > row[ids[i]] + TOL).sum()) + 1, int((row > row[ids[i]] - TOL).sum()) + 1
        assert lo <= entry["ranks"][i] <= hi
        if k:
            want = np.sort(row)[::-1][:k]
            np.testing.assert_allclose(entry["top_logprobs"][i], want, atol=TOL)
            for token, lp in zip(entry["top_token_ids"][i], entry["top_logprobs"][i]):
                assert abs(row[token] - lp) < TOL


def test_lens_of_prompt_and_generated_tokens(client, reference, tiny_engine):
    num_layers = tiny_engine.info.num_layers
    out = client.post("/v1/completions", json={
        "model": "tiny", "prompt": "Read the lens", "max_tokens": 4, "seed": 5, "n": 2,
        "output_lens": {"layers": [0, 1, -1], "top_k": 3}}).json()
    for choice in out["choices"]:
        lens = choice["logit_lens"]
        ids = lens["token_ids"]
        assert len(lens["tokens"]) == len(ids) and [e["layer"] for e in lens["layers"]] == [0, 1, num_layers]
        for entry in lens["layers"]:
            assert len(entry["logprobs"]) == len(ids) and len(entry["top_tokens"][1]) == 3
            check_layer(entry, ids, lens64(reference, ids, entry["layer"], num_layers), 3)
    # the last layer's lens is the model's own distribution: the echoed prompt's log probabilities
    plain = client.post("/v1/completions", json={"model": "tiny", "prompt": "Read the lens", "max_tokens": 0,
                                                 "echo": True, "logprobs": 0,
                                                 "output_lens": [num_layers]}).json()["choices"][0]
    last = plain["logit_lens"]["layers"][0]
    np.testing.assert_allclose(last["logprobs"][1:], plain["logprobs"]["token_logprobs"][1:], atol=1e-6)
    assert len(last["top_tokens"][1]) == 5  # top_k defaults to 5


def test_lens_on_the_transformers_runner(tiny_model, tokenizer, reference):
    engine = Engine(tiny_model, tokenizer, "hf", [], fast=False)
    num_layers = engine.info.num_layers
    engine.start()
    try:
        g = SequenceGroup("x", tokenizer("The cat sat on").input_ids,
                          SamplingParams(max_tokens=3, temperature=0, lens_layers=(1, -1), lens_top_k=2), engine.table)
        asyncio.run(engine.run_groups([g]))
    finally:
        engine.stop()
    ids = g.prompt_ids + g.sequences[0].token_ids
    assert sorted(g.sequences[0].lens) == [1, num_layers]
    for layer, cols in g.sequences[0].lens.items():
        ref = lens64(reference, ids, layer, num_layers)
        entry = {"logprobs": [None] + cols.logprobs[1:].tolist(), "ranks": [None] + cols.ranks[1:].tolist(),
                 "top_token_ids": [None] + cols.top_ids[1:].tolist(),
                 "top_logprobs": [None] + cols.top_logprobs[1:].tolist()}
        check_layer(entry, ids, ref, 2)


def test_lens_in_chat_and_plain_requests_unchanged(client):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "seed": 2}
    plain = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    lensed = client.post("/v1/chat/completions", json={**body, "output_lens": [1]}).json()["choices"][0]
    assert "logit_lens" not in plain and lensed["message"] == plain["message"]
    assert lensed["logit_lens"]["layers"][0]["layer"] == 1


@pytest.mark.parametrize("value,param,needle", [
    ({"layers": [99]}, "output_lens", "layer 99 does not exist"),
    ({"layers": []}, "output_lens", "non-empty array"),
    ({"layers": [1], "top_k": 101}, "output_lens.top_k", "from 0 to 100"),
    ({"layers": [1], "bogus": 1}, None, "bogus"),
    ("1", "output_lens", "array of layer indices"),
])
def test_lens_refusals(client, value, param, needle):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "output_lens": value})
    err = r.json()["error"]
    assert r.status_code == 400 and needle in err["message"]
    if param:
        assert err["param"] == param


def test_lens_cap_and_stream(tiny_engine):
    with TestClient(create_app(tiny_engine, Limits(max_lens_rows=20))) as c:
        assert c.get("/v1/models/tiny").json()["limits"]["max_lens_rows"] == 20
        ok = c.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3, 4, 5], "max_tokens": 5,
                                             "output_lens": [0, 1]})
        assert ok.status_code == 200  # (5 + 5) x 2 layers = 20
        over = c.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3, 4, 5], "max_tokens": 6,
                                               "output_lens": [0, 1, -1, 2]})  # -1 and 2 are one layer
        err = over.json()["error"]
        assert over.status_code == 400 and err["param"] == "output_lens" and "33" in err["message"]
        streamed = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "stream": True,
                                                   "output_lens": [1]})
        assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "output_lens"
