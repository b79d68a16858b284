"""output_residual_stream against a float64 forward of the same weights and transformers'
output_hidden_states."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

TOL = 1e-5


def decode(rs, layer):
    raw = base64.b64decode(rs["data"][str(layer)])
    dtype = {"float32": "<f4", "float16": "<f2"}[rs["dtype"]]
    return np.frombuffer(raw, dtype=dtype).reshape(rs["num_positions"], rs["d_model"]).astype(np.float32)


def hidden64(reference, ids):
    with torch.inference_mode():
        out = reference.model(torch.tensor([ids]), output_hidden_states=True)
    return [h[0].numpy() for h in out.hidden_states]


def test_prompt_and_generated_vectors_match_float64(client, reference, tiny_engine):
    out = client.post("/v1/completions", json={
        "model": "tiny", "prompt": "Read my activations", "max_tokens": 5, "seed": 3, "logprobs": 0,
        "return_tokens_as_token_ids": True, "echo": True,
        "output_residual_stream": {"layers": [0, 1, -1], "dtype": "float32", "encoding": "base64"}}).json()
    choice = out["choices"][0]
    ids = [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
    rs = choice["residual_stream"]
    num_layers = tiny_engine.info.num_layers
    assert rs["layers"] == [0, 1, -1] and rs["num_positions"] == len(ids) and rs["d_model"] == 64
    hs = hidden64(reference, ids)
    np.testing.assert_allclose(decode(rs, 0), hs[0], atol=TOL)
    np.testing.assert_allclose(decode(rs, 1), hs[1], atol=TOL)  # equal to hidden_states[l] for l < L
    # the last layer is the stream before the final norm: the float64 norm of it is hidden_states[L]
    last = torch.from_numpy(decode(rs, -1)).double()
    normed = reference.model.model.norm(last).numpy()
    np.testing.assert_allclose(normed, hs[num_layers], atol=1e-4)
    assert not np.allclose(decode(rs, -1), hs[num_layers], atol=1e-3)


@pytest.mark.parametrize("dtype,encoding", [("float16", "base64"), ("bfloat16", "base64"), ("float32", "json"),
                                            ("bfloat16", "json")])
def test_dtypes_and_encodings(client, reference, tiny_engine, dtype, encoding):
    ids = [10, 20, 30, 40]
    out = client.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 0,
                                                "output_residual_stream": {"layers": [2], "dtype": dtype,
                                                                           "encoding": encoding}}).json()
    rs = out["choices"][0]["residual_stream"]
    assert rs["dtype"] == dtype and rs["encoding"] == encoding and rs["num_positions"] == 4
    if encoding == "json":
        got = np.array(rs["data"]["2"], dtype=np.float32)
    elif dtype == "bfloat16":
        bits = np.frombuffer(base64.b64decode(rs["data"]["2"]), dtype="<u2").astype(np.uint32) << 16
        got = bits.view(np.float32).reshape(4, 64)
    else:
        got = decode(rs, 2)
    # layer 2 of 2 is the last: compare before the final norm via the float64 reference's hook
    captured = {}
    handle = reference.model.model.layers[1].register_forward_hook(lambda m, i, o: captured.setdefault("h", o))
    with torch.inference_mode():
        reference.model(torch.tensor([ids]))
    handle.remove()
    want = (captured["h"][0] if isinstance(captured["h"], tuple) else captured["h"])[0].numpy()
    tol = {"float32": TOL, "float16": 2e-3, "bfloat16": 2e-2}[dtype]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_score_and_chat_residual(client, reference, tiny_engine):
    out = client.post("/v1/score", json={"model": "tiny", "input": "Score me", "output_residual_stream": [1]}).json()
    item = out["data"][0]
    rs = item["residual_stream"]
    assert rs["num_positions"] == item["num_tokens"] == len(item["token_ids"])
    bos = tiny_engine.info.bos_token_id
    hs = hidden64(reference, [bos] + item["token_ids"])
    np.testing.assert_allclose(decode(rs, 1), hs[1][1:], atol=TOL)  # the input's tokens only
    chat = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 2, "output_residual_stream": [0]}).json()
    rs = chat["choices"][0]["residual_stream"]
    assert rs["num_positions"] == chat["usage"]["prompt_tokens"] + chat["usage"]["completion_tokens"]


def test_residual_errors(client):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "stream": True,
                                              "output_residual_stream": [0]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "output_residual_stream"


@pytest.mark.parametrize("max_tokens", [4, 0])
def test_captures_are_an_item_of_the_step_after_the_last_token(client, reference, tiny_engine, max_tokens):
    """A request's captures are an item of the engine's plan (Plan.captures): read in the step after the
    one that gave its last token (or read its prompt), once, and its answer goes out with them; a request
    beside it that asks for none is never in a plan's captures. The vectors are the float64 forward's."""
    plans = []
    schedule = tiny_engine.scheduler.schedule

    def recording(*args, **kwargs):
        plan = schedule(*args, **kwargs)
        if plan is not None:
            plans.append({kind: {g.request_id for g in getattr(plan, kind)} for kind in ("score", "decode", "captures")}
                         | {"prefill": {c.group.request_id for c in plan.prefill}})
        return plan

    tiny_engine.scheduler.schedule = recording
    try:
        plain = client.post("/v1/completions", json={"model": "tiny", "prompt": "No captures here", "max_tokens": 3,
                                                     "temperature": 0})
        out = client.post("/v1/completions", json={
            "model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "echo": True,
            "logprobs": 0, "return_tokens_as_token_ids": True,
            "output_residual_stream": {"layers": [1], "dtype": "float32", "encoding": "base64"}})
    finally:
        del tiny_engine.scheduler.schedule  # the class's method again
    assert plain.status_code == out.status_code == 200, out.text
    rid, other = out.headers["x-request-id"], plain.headers["x-request-id"]
    worked = [i for i, plan in enumerate(plans) if any(rid in plan[kind] for kind in ("score", "prefill", "decode"))]
    captured = [i for i, plan in enumerate(plans) if rid in plan["captures"]]
    assert worked and captured == [worked[-1] + 1]
    assert not any(other in plan["captures"] for plan in plans)
    choice = out.json()["choices"][0]
    ids = [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
    assert len(ids) == 4 + max_tokens and choice["residual_stream"]["num_positions"] == len(ids)
    np.testing.assert_allclose(decode(choice["residual_stream"], 1), hidden64(reference, ids)[1], atol=TOL)


def test_a_failed_capture_fails_its_request_alone_and_the_engine_serves_on(tiny_model, tokenizer, reference):
    """A capture that fails (its pass raises) fails that request with the envelope's 500 and leaves no
    group waiting for captures; the request beside it and the same request sent again are answered, the
    latter with the float64 forward's vectors."""
    from fastapi.testclient import TestClient

    from logprobe.api.app import create_app
    from logprobe.config import Limits
    from logprobe.engine.engine import Engine

    engine = Engine(tiny_model, tokenizer, "test/tiny-llama", ["tiny"])
    engine.start()
    real, calls = engine.runner.residual_stream, []

    def failing_once(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("the capture's pass failed")
        return real(*args, **kwargs)

    engine.runner.residual_stream = failing_once
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "echo": True, "logprobs": 0, "return_tokens_as_token_ids": True,
            "output_residual_stream": {"layers": [1], "dtype": "float32", "encoding": "base64"}}
    try:
        with TestClient(create_app(engine, Limits()), raise_server_exceptions=False) as client:
            failed = client.post("/v1/completions", json=body)
            assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
            assert "capture" not in failed.text  # no internals
            assert engine.scheduler.capturing == [] and engine.num_in_flight == 0
            assert engine.request_failures == 1 and engine.step_failures == 0
            plain = client.post("/v1/completions", json={"model": "tiny", "prompt": "after", "max_tokens": 2})
            again = client.post("/v1/completions", json=body)
    finally:
        engine.stop()
    assert plain.status_code == again.status_code == 200
    choice = again.json()["choices"][0]
    ids = [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
    np.testing.assert_allclose(decode(choice["residual_stream"], 1), hidden64(reference, ids)[1], atol=TOL)
