"""The seam between the API and the model (src/logprobe/backend/): the API imports and serves without
torch, its records cross a process boundary, both backends fit the protocol, what the API hands over,
and how it answers when a backend fails or its client goes away."""

from __future__ import annotations

import asyncio
import json
import logging
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest
from fastapi.testclient import TestClient

from fake_backend import FakeBackend, TinyTokenizer
from paused_engine import paused_after, timer_after
from logprobe.api.app import create_app
from logprobe.backend import (Backend, BackendUnavailable, Delta, RequestAborted, GenerationOutput, GenerationRequest,
                              Intervention, RequestConflict, SamplingParams, StreamEnd)
from logprobe.config import AdmissionSettings, Limits

TESTS = Path(__file__).resolve().parent.parent

# ---- the API without torch ----------------------------------------------------------------------

WITHOUT_TORCH = r'''
import sys, importlib.abc
BLOCKED = ("torch", "transformers")

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is made unimportable by this test")
        return None

sys.meta_path.insert(0, Block())
for name in list(sys.modules):
    if name.split(".")[0] in BLOCKED:
        del sys.modules[name]
try:
    import torch  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("the blocker does not block torch")

sys.path.insert(0, TESTS)
import base64, json, pkgutil, importlib
import logprobe.api.app
import logprobe.backend
import logprobe.output
for mod in pkgutil.iter_modules(logprobe.output.__path__):
    importlib.import_module("logprobe.output." + mod.name)
for mod in pkgutil.iter_modules(logprobe.api.__path__):
    importlib.import_module("logprobe.api." + mod.name)
from starlette.testclient import TestClient
from fake_backend import FakeBackend, TinyTokenizer

backend = FakeBackend(TinyTokenizer())
V, D = backend.info.vocab_size, backend.info.d_model
with TestClient(logprobe.api.app.create_app(backend), raise_server_exceptions=False) as c:
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 4, "logprobs": 2, "echo": True, "seed": 3}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith("Hello there")
    assert len(lp["tokens"]) == 1 + len("Hello there") + 4 and lp["token_logprobs"][0] is None
    assert lp["tokens"][0] == "<s>" and lp["text_offset"][:2] == [0, 0]

    r = c.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    blocks = r.text.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]"
    chunks = [json.loads(b[len("data: "):]) for b in blocks[:-2]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert "".join(ch["text"] for c_ in chunks[:-1] for ch in c_["choices"]) == choice["text"]
    assert [ch["finish_reason"] for c_ in chunks[:-1] for ch in c_["choices"]][-1] == choice["finish_reason"]

    r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": 3, "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["prompt_logprobs"] is None
    assert len(out["choices"][0]["logprobs"]["content"]) <= 3

    r = c.post("/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 3, "stream": True,
                                      "include": ["message.output_text.logprobs"], "top_logprobs": 2})
    assert r.status_code == 200 and r.text.startswith("event: response.created"), r.text
    assert r.text.split("\n\n")[-2].startswith("event: response.") and "[DONE]" not in r.text

    r = c.post("/v1/score", json={"model": "tiny", "input": "abc", "context": "x", "top_logprobs": 2})
    assert r.status_code == 200, r.text
    data = r.json()["data"][0]
    assert data["tokens"] == ["a", "b", "c"] and data["num_tokens"] == 3 and len(data["top_logprobs"]) == 3

    r = c.post("/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 0, "prompt_logprobs": -1})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == 4 and plp[0] is None and all(len(row) == V for row in plp[1:])

    r = c.post("/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 2, "temperature": 0,
                                        "output_residual_stream": {"layers": [0, -1], "dtype": "bfloat16"}})
    assert r.status_code == 200, r.text
    res = r.json()["choices"][0]["residual_stream"]
    assert res["num_positions"] == 4 + 2 and res["d_model"] == D and res["layers"] == [0, -1]
    for layer in ("0", "-1"):
        assert len(base64.b64decode(res["data"][layer])) == 6 * D * 2

    r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "n": 0})
    assert r.status_code == 400
    assert set(r.json()) == {"error", "request_id"} and r.json()["error"]["param"] == "n"

    r = c.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ready" and r.json()["tokens_held"] == 0
    r = c.get("/metrics")
    assert r.status_code == 200 and "logprobe_requests_total" in r.text

leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert not leaked, leaked
print("served without torch")
'''


def test_the_api_serves_without_torch():
    code = f"TESTS = {str(TESTS)!r}\n" + WITHOUT_TORCH
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=TESTS)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "served without torch" in done.stdout


def test_the_torch_blocker_is_real():
    """The same script fails when the API imports torch (here: a module the script imports does)."""
    imports_torch = WITHOUT_TORCH.replace("import logprobe.api.app\n",
                                          "import logprobe.api.app\nimport logprobe.engine.engine\n")
    code = f"TESTS = {str(TESTS)!r}\n" + imports_torch
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=TESTS)
    assert done.returncode != 0 and "made unimportable by this test" in done.stderr


# ---- records and the protocol --------------------------------------------------------------------


def same(a, b) -> None:
    """Deep equality, numpy arrays included (nan equal to nan)."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    elif hasattr(a, "__dataclass_fields__"):
        for name in a.__dataclass_fields__:
            same(getattr(a, name), getattr(b, name))
    else:
        assert a == b


@pytest.fixture(scope="module")
def tiny_backend():
    return FakeBackend(TinyTokenizer())


def test_records_survive_pickle(tiny_backend):
    params = SamplingParams(max_tokens=3, n=2, seed=4, stop=["zz"], stop_token_ids=frozenset({257}), logprobs=2,
                            echo=True, prompt_logprobs=-1, residual_layers=(0, 2))
    request = GenerationRequest("req_1", [256, 104, 105], params, text_start=2)
    same(pickle.loads(pickle.dumps(request)), request)
    steered = SamplingParams(max_tokens=2, return_unmodified=True, lens_layers=(1, -1), interventions=(
        Intervention(2, "add", (0, -1), np.arange(8, dtype=np.float32)),
        Intervention(1, "patch", None, source_ids=(256, 99), source_position=-1, source_layer=2, source_text="hi")))
    steered_request = GenerationRequest("req_0", [256, 104], steered, text_start=2)
    same(pickle.loads(pickle.dumps(steered_request)), steered_request)
    (out,) = asyncio.run(tiny_backend.run([request]))
    assert isinstance(out, GenerationOutput) and out.prompt_columns.full.shape == (3, 258)
    assert out.choices[0].residual[2].shape[1] == tiny_backend.info.d_model
    same(pickle.loads(pickle.dumps(out)), out)

    async def items():
        return [x async for x in tiny_backend.stream([GenerationRequest("req_2", [256, 104], SamplingParams(
            max_tokens=3, logprobs=1, echo=True, seed=1))], 1)]

    got = asyncio.run(items())
    assert isinstance(got[-1], StreamEnd) and all(isinstance(d, Delta) for x in got[:-1] for d in x)
    assert got[0][0].is_first and got[0][0].prompt_columns is not None
    same(pickle.loads(pickle.dumps(got)), got)


def test_both_backends_are_backends(tiny_backend, fake_backend, tiny_engine):
    assert isinstance(tiny_backend, Backend) and isinstance(fake_backend, Backend)
    assert isinstance(tiny_engine, Backend)
    for backend in (tiny_backend, tiny_engine):
        assert set(backend.stats()) >= {"in_flight", "steps", "kv_cache_bytes", "failing", "step_failures",
                                        "request_failures"}


def test_the_fake_answers_like_the_engine_in_shape(fake_backend, tiny_engine):
    """The same request on both: the same columns, widths, dtypes and counts (not the same numbers)."""
    params = SamplingParams(max_tokens=4, n=2, seed=1, logprobs=3, echo=True, prompt_logprobs=2,
                            residual_layers=(0, 2), stop_token_ids=tiny_engine.info.stop_token_ids)
    request = GenerationRequest("req_3", [504, 3145, 314], params, text_start=7)

    async def both():
        return (await fake_backend.run([request]))[0], (await tiny_engine.run([request]))[0]

    fake, real = asyncio.run(both())
    for name in ("logprobs", "ranks", "top_ids", "top_logprobs"):
        a, b = getattr(fake.prompt_columns, name), getattr(real.prompt_columns, name)
        assert (a.dtype, a.shape) == (b.dtype, b.shape), name
    assert np.isnan(fake.prompt_columns.logprobs[0]) and fake.prompt_columns.ranks[0] == 0
    assert fake.prompt_columns.full is None and real.prompt_columns.full is None
    for f, r in zip(fake.choices, real.choices):
        for name in ("token_ids", "logprobs", "top_ids", "top_logprobs"):
            a, b = getattr(f, name), getattr(r, name)
            assert (a.dtype, a.shape) == (b.dtype, b.shape), name
        assert f.offsets[0] == r.offsets[0] == 7 and f.num_generated == r.num_generated == 4
        assert sorted(f.residual) == sorted(r.residual) == [0, 2]
        assert f.residual[2].shape == r.residual[2].shape == (3 + 4, 64) and f.residual[2].dtype == np.float32


def test_the_fake_is_a_function_of_the_tokens(fake_backend):
    """Prompt columns are the model's log probabilities: a later request can check them."""
    ids = [504, 3145, 314, 3145, 314]
    params = SamplingParams(max_tokens=2, temperature=0, logprobs=2, prompt_logprobs=-1)
    (out,) = asyncio.run(fake_backend.run([GenerationRequest("req_4", ids, params)]))
    pc = out.prompt_columns
    for i in range(1, len(ids)):
        row = fake_backend.logprobs_after(ids[:i])
        assert pc.logprobs[i] == row[ids[i]] and pc.ranks[i] == 1 + (row > row[ids[i]]).sum()
        np.testing.assert_array_equal(pc.full[i], row)
        assert pc.full_ranks[i][100] == pc.full_ranks[i][101] == pc.full_ranks[i][102]  # a three-way tie
    choice = out.choices[0]
    assert choice.token_ids[0] == np.argmax(fake_backend.logprobs_after(ids))  # greedy
    assert choice.top_ids[0][0] == choice.token_ids[0] and choice.top_logprobs[0][0] == choice.logprobs[0]


@pytest.mark.parametrize("which", ["tiny", "smol"])
def test_the_fakes_stream_is_its_answer(tiny_backend, fake_backend, which):
    """Streamed deltas add up to the answer without streaming, stop strings (held back, cut) included;
    each choice's first delta is marked and its last carries the finish_reason."""
    backend = tiny_backend if which == "tiny" else fake_backend
    prompt = backend.tokenizer("Once upon").input_ids

    async def answer(params):
        (out,) = await backend.run([GenerationRequest("a", prompt, params, text_start=3)])
        items = [x async for x in backend.stream([GenerationRequest("s", prompt, params, text_start=3)],
                                                 params.logprobs or 0)]
        return out, items

    for seed in range(24):
        plain = SamplingParams(max_tokens=12, n=3, seed=seed, logprobs=2)
        out, _ = asyncio.run(answer(plain))
        text = out.choices[1].text
        length = 1 + seed % 3  # one-character stops are held back by nothing
        stops = [text[4:4 + length], "zq"] if len(text) > 8 else ["zq"]
        params = SamplingParams(**{**plain.__dict__, "stop": stops, "stop_token_ids": backend.info.stop_token_ids})
        out, items = asyncio.run(answer(params))
        assert isinstance(items[-1], StreamEnd) and items[-1].num_generated == [out.num_generated]
        deltas = [d for x in items[:-1] for d in x]
        for choice in out.choices:
            mine = [d for d in deltas if d.seq_index == choice.index]
            assert [d.is_first for d in mine] == [True] + [False] * (len(mine) - 1)
            assert [d.finish_reason for d in mine] == [None] * (len(mine) - 1) + [choice.finish_reason]
            assert "".join(d.text for d in mine) == choice.text
            same(np.concatenate([d.token_ids for d in mine]), choice.token_ids)
            same(np.concatenate([d.top_logprobs for d in mine]), choice.top_logprobs)
            assert sum((d.offsets for d in mine), []) == choice.offsets
        if len(text) > 8:
            assert out.choices[1].finish_reason == "stop" and stops[0] not in out.choices[1].text


# ---- what crosses the seam ------------------------------------------------------------------------


def last_call(backend, kind="run"):
    call = backend.calls[-1]
    assert call.kind == kind
    return call.requests


def test_what_completions_hand_over(fake_client, fake_backend):
    body = {"model": "tiny", "prompt": ["The sky", "Is blue"], "max_tokens": 3, "n": 2, "seed": 11, "echo": True,
            "logprobs": 1, "stop": ["zz"], "output_residual_stream": [-1, 0, 2]}
    r = fake_client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    requests = last_call(fake_backend)
    assert len(requests) == 2 and requests[0].request_id == requests[1].request_id == r.headers["x-request-id"]
    for req, prompt in zip(requests, body["prompt"]):
        p = req.params
        assert req.prompt_ids == fake_backend.tokenizer(prompt).input_ids
        assert p.stop_token_ids == fake_backend.info.stop_token_ids == frozenset({fake_backend.tokenizer.eos_token_id})
        assert p.residual_layers == (0, 2)  # -1 is the last layer, 2; each once, in order
        assert (p.n, p.seed, p.max_tokens, p.logprobs, p.echo, p.stop) == (2, 11, 3, 1, True, ["zz"])
        assert req.text_start == len(prompt)  # the generated text follows the echoed prompt
    for choice in r.json()["choices"]:
        req = requests[choice["index"] // 2]
        offsets = choice["logprobs"]["text_offset"][len(req.prompt_ids):]
        assert choice["text"][:req.text_start] == body["prompt"][choice["index"] // 2]
        assert all(o >= req.text_start for o in offsets) and offsets[:1] in ([], [req.text_start])


def test_what_token_id_echo_hands_over(fake_client, fake_backend):
    eot = fake_backend.tokenizer.convert_ids_to_tokens(0)
    r = fake_client.post("/v1/completions", json={"model": "tiny", "prompt": [0, 0], "echo": True, "max_tokens": 1})
    assert r.status_code == 200, r.text
    (req,) = last_call(fake_backend)
    assert req.text_start == 2 * len(eot) and req.params.residual_layers == ()


def test_what_chat_and_score_hand_over(fake_client, fake_backend):
    messages = [{"role": "user", "content": "hi"}]
    r = fake_client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "seed": 5, "n": 3,
                                                       "output_residual_stream": [-2]})
    assert r.status_code == 200, r.text
    (req,) = last_call(fake_backend)
    text = fake_backend.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert req.prompt_ids == fake_backend.tokenizer(text, add_special_tokens=False).input_ids
    assert req.params.max_tokens == 256 - len(req.prompt_ids)  # no max_tokens: the rest of the context
    assert req.params.stop_token_ids == frozenset({fake_backend.tokenizer.eos_token_id}) and req.params.residual_layers == (1,)
    assert (req.params.n, req.params.seed, req.text_start) == (3, 5, 0)

    r = fake_client.post("/v1/score", json={"model": "tiny", "input": ["a b", "c"], "context": "x",
                                            "output_residual_stream": [-3]})
    assert r.status_code == 200, r.text
    requests = last_call(fake_backend)
    assert len(requests) == 2
    for req in requests:
        p = req.params
        assert (p.max_tokens, p.echo, p.logprobs, p.residual_layers) == (0, True, 0, (0,))
        assert req.prompt_ids[0] == fake_backend.info.bos_token_id  # add_bos: BOS in front


def test_a_stream_hands_over_its_width(fake_client, fake_backend):
    r = fake_client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2, "logprobs": 4,
                                                  "stream": True})
    assert r.status_code == 200
    assert fake_backend.calls[-1].kind == "stream" and fake_backend.calls[-1].k == 4
    assert fake_backend.streams[-1].finished and fake_backend.streams[-1].closed


# ---- failures ------------------------------------------------------------------------------------


def sse_events(text: str) -> list:
    blocks = text.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]", text[-300:]
    return [json.loads(b[len("data: "):]) for b in blocks[:-2]]


def nothing_held(client) -> None:
    health = client.get("/health").json()
    assert health["tokens_held"] == 0 and health["requests_running"] == 0, health


# greedy: the same 5 tokens each run (a sampled one is now and then the end of sequence, and these tests count)
BODY = {"model": "tiny", "prompt": "The sky", "max_tokens": 5, "logprobs": 1, "temperature": 0}


def test_unavailable_backend_is_503(fake_client, fake_backend, monkeypatch):
    monkeypatch.setattr(fake_backend, "fail_with", BackendUnavailable("the replica went away"))
    for path, body in [("/v1/completions", BODY), ("/v1/score", {"model": "tiny", "input": "x"}),
                       ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]})]:
        r = fake_client.post(path, json=body)
        assert r.status_code == 503, r.text
        data = r.json()
        assert set(data) == {"error", "request_id"} and r.headers["x-request-id"] == data["request_id"]
        assert data["error"]["type"] == "server_error" and data["error"]["code"] == "unavailable"
        assert data["error"]["message"] == "the replica went away"
        nothing_held(fake_client)
    monkeypatch.setattr(fake_backend, "fail_with", BackendUnavailable())
    err = fake_client.post("/v1/completions", json=BODY).json()["error"]
    assert err["code"] == "unavailable" and "try again" in err["message"]


@pytest.mark.parametrize("after", [0, 2])
def test_unavailable_backend_while_streaming_is_an_event(fake_client, fake_backend, monkeypatch, after):
    """Lost before the first chunk: the stream's status is 503 (nothing was sent yet); lost after it:
    an error event after the chunks sent."""
    monkeypatch.setattr(fake_backend, "fail_with", BackendUnavailable("the replica went away"))
    monkeypatch.setattr(fake_backend, "fail_after_steps", after)
    for path, body in [("/v1/completions", BODY),
                       ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                 "max_tokens": 5, "temperature": 0})]:
        r = fake_client.post(path, json={**body, "stream": True})
        if after == 0:
            err = r.json()["error"]
            assert r.status_code == 503 and err["code"] == "unavailable" and "went away" in err["message"]
            assert fake_backend.streams[-1].closed and not fake_backend.streams[-1].finished
            nothing_held(fake_client)
            continue
        assert r.status_code == 200
        events = sse_events(r.text)
        assert events[-1]["error"]["code"] == "unavailable" and events[-1]["error"]["type"] == "server_error"
        assert events[-1]["request_id"] == r.headers["x-request-id"]
        assert all("choices" in e for e in events[:-1]) and (len(events) > 1) == (after > 0)
        assert fake_backend.streams[-1].closed and not fake_backend.streams[-1].finished
        nothing_held(fake_client)


@pytest.mark.parametrize("after", [0, 2])
def test_a_requests_conflict_is_its_400(fake_client, fake_backend, monkeypatch, after):
    """A request whose own fields leave nothing to generate (RequestConflict, raised by the backend at its
    first step or a later one): the endpoint's 400 with the backend's message and param, or, once chunks
    went out, the stream's error event with them; nothing held after, no failure in /health."""
    message = "Invalid request: 'structured_outputs' and 'allowed_token_ids' together allow no token at ..."
    monkeypatch.setattr(fake_backend, "fail_with", RequestConflict(message, "structured_outputs"))
    monkeypatch.setattr(fake_backend, "fail_after_steps", after)
    failures = fake_client.get("/health").json()["engine_failures"]
    for path, body in [("/v1/completions", BODY),
                       ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                 "max_tokens": 5, "temperature": 0})]:
        for stream in (False, True):
            r = fake_client.post(path, json={**body, "stream": stream})
            if stream and after:
                assert r.status_code == 200
                *chunks, last = sse_events(r.text)
                assert chunks and all("choices" in c for c in chunks)
                err = last["error"]
            else:
                assert r.status_code == 400, r.text
                err = r.json()["error"]
            assert (err["type"], err["code"], err["param"], err["message"]) == (
                "invalid_request_error", "invalid_request", "structured_outputs", message)
            nothing_held(fake_client)
    health = fake_client.get("/health").json()
    assert health["engine_failures"] == failures and health["status"] == "ready"


@pytest.mark.parametrize("stream", [False, True])
def test_a_lost_request_costs_its_key_nothing(tokenizer, stream):
    """A request the backend lost (its replica died) gives every token back to the key's budget; one the
    backend answered is charged its prompt and generated tokens; a stream lost after some tokens is
    charged those tokens only. The admission's clock stands still, so the budget does not refill
    meanwhile and every count is exact, however slow the machine."""
    backend = FakeBackend(tokenizer)
    app = create_app(backend, Limits(), AdmissionSettings(tokens_per_minute=600))
    app.state.admission.clock = lambda: 1000.0
    body = {**BODY, "max_tokens": 5, "stream": stream}
    with TestClient(app, raise_server_exceptions=False) as c:
        bucket = lambda: app.state.admission._buckets["anonymous"].level  # noqa: E731
        assert c.post("/v1/completions", json=body).status_code == 200
        spent = 600 - bucket()
        prompt = len(tokenizer(BODY["prompt"]).input_ids)
        assert spent == prompt + 5
        backend.fail_with = BackendUnavailable("gone")
        if stream:
            backend.fail_after_steps = 2
        before = bucket()
        r = c.post("/v1/completions", json=body)
        assert (r.status_code == 200 and "unavailable" in r.text) if stream else r.status_code == 503
        lost = before - bucket()
        assert 0 <= lost <= (2 if stream else 0), lost


def test_other_backend_errors_are_500_without_internals(fake_client, fake_backend, monkeypatch):
    monkeypatch.setattr(fake_backend, "fail_with", RuntimeError("secret internal detail /path/to/file.py"))
    r = fake_client.post("/v1/completions", json=BODY)
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "internal_error" and "secret" not in r.text
    monkeypatch.setattr(fake_backend, "fail_after_steps", 2)
    events = sse_events(fake_client.post("/v1/completions", json={**BODY, "stream": True}).text)
    assert events[-1]["error"]["code"] == "internal_error" and "secret" not in json.dumps(events)
    assert any("choices" in e for e in events[:-1])  # some text went out before the error
    nothing_held(fake_client)
    monkeypatch.undo()
    assert fake_client.post("/v1/completions", json=BODY).status_code == 200


def test_a_failing_backend_shows_in_health(tokenizer):
    backend = FakeBackend(tokenizer)
    with TestClient(create_app(backend), raise_server_exceptions=False) as c:
        backend.fail_with = BackendUnavailable("gone")
        c.post("/v1/completions", json=BODY)
        backend.fail_with, backend.failing = None, True
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "failing"
        assert r.json()["engine_failures"] == {"steps": 0, "requests": 1}
        assert r.json()["last_error"]["type"] == "BackendUnavailable"
        backend.failing = False
        assert c.get("/health").json()["status"] == "ready"


# ---- the client goes away ------------------------------------------------------------------------


async def call_then_leave(app, body: dict, leave_after_first_chunk: bool, leave_when=None) -> list[dict]:
    """POST /v1/completions straight through ASGI; the client disconnects after the first body chunk
    (a stream), or once `leave_when()` holds (polled). Returns the messages the app sent."""
    raw = orjson.dumps(body)
    sent, chunk = [], asyncio.Event()
    asked = 0

    async def receive():
        nonlocal asked
        asked += 1
        if asked == 1:
            return {"type": "http.request", "body": raw, "more_body": False}
        if leave_after_first_chunk:
            await chunk.wait()
        else:
            while not leave_when():
                await asyncio.sleep(0.005)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            chunk.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5000), "server": ("testserver", 80),
             "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode())]}
    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent


@pytest.fixture
def slow():
    """A backend of its own that takes 10 ms a step, and its app."""
    backend = FakeBackend(TinyTokenizer(), step_delay=0.01)
    return backend, create_app(backend, Limits(), AdmissionSettings())


def test_a_stream_whose_client_left_is_closed(slow):
    backend, app = slow
    body = {"model": "tiny", "prompt": "x", "max_tokens": 200, "stream": True, "seed": 1}
    sent = asyncio.run(call_then_leave(app, body, leave_after_first_chunk=True))
    assert sent[0]["status"] == 200
    (record,) = backend.streams
    assert record.closed and not record.finished  # closed early: the requests end
    assert 0 < sum(len(d.token_ids) for d in record.deltas) < 200
    assert backend.stats()["in_flight"] == 0
    admission = app.state.admission
    assert (admission.held, admission.running) == (0, 0)


def test_a_run_whose_client_left_is_cancelled(slow, caplog):
    """... and is charged, logged and counted with the tokens generated until then (its prompt's 2
    tokens, and the tokens of the steps run before the client left: it leaves after the fifth of 200)."""
    backend, app = slow
    body = {"model": "tiny", "prompt": "x", "max_tokens": 200, "seed": 1}
    with caplog.at_level(logging.INFO, logger="logprobe.access"):
        sent = asyncio.run(call_then_leave(app, body, leave_after_first_chunk=False,
                                           leave_when=lambda: backend.num_steps >= 5))
    assert sent[0]["status"] == 499
    assert backend.cancelled == [[backend.calls[0].requests[0].request_id]]
    assert backend.stats()["in_flight"] == 0
    assert (app.state.admission.held, app.state.admission.running) == (0, 0)
    (line,) = [json.loads(r.getMessage()) for r in caplog.records if r.name == "logprobe.access"]
    assert line["status"] == 499 and line["prompt_tokens"] == 2
    assert 3 <= line["completion_tokens"] < 200, line


def test_a_timed_out_run_is_charged_what_it_generated(tiny_engine, caplog, monkeypatch):
    """A plain request stopped by the request time-out (504) is logged and counted in the metrics with
    the tokens the engine generated for it until then (`release` charges the key's budget the same).
    The engine is paused after 3 steps (the prompt and its first token, then two more tokens for each of
    the 16 choices) until the answer has come, and the time-out's clock starts only then: 48 tokens, on
    any machine."""
    from logprobe.api.serving import holding

    app = create_app(tiny_engine, Limits(), AdmissionSettings(request_timeout=0.2))
    with TestClient(app) as c, caplog.at_level(logging.INFO, logger="logprobe.access"):
        with paused_after(tiny_engine, steps=3) as paused:
            monkeypatch.setattr(holding, "asyncio", timer_after(paused))
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6], "max_tokens": 250, "n": 16,
                                                "temperature": 1.0, "seed": 1})
        assert r.status_code == 504, r.text
        metrics = c.get("/metrics").text
    (line,) = [json.loads(r.getMessage()) for r in caplog.records
               if r.name == "logprobe.access" and json.loads(r.getMessage())["path"] == "/v1/completions"]
    assert line["status"] == 504 and line["prompt_tokens"] == 2
    assert line["completion_tokens"] == 3 * 16, line
    counted = [float(x.split()[-1]) for x in metrics.splitlines() if x.startswith("logprobe_completion_tokens_total")]
    assert counted == [line["completion_tokens"]]


def test_a_queued_request_whose_client_left_leaves_the_queue_at_once():
    """A request waiting for its hold whose client disconnects is taken out of the queue then (499), not
    when its turn comes: a later request that fits beside the running one is admitted without waiting,
    and the running one is untouched."""
    backend = FakeBackend(TinyTokenizer(), step_delay=0.01)
    app = create_app(backend, Limits(max_tokens_in_flight=260), AdmissionSettings(queue_timeout=20))
    admission = app.state.admission

    async def main():
        holder = asyncio.ensure_future(call_then_leave(
            app, {"model": "tiny", "prompt": "x", "max_tokens": 200, "seed": 1}, False, leave_when=lambda: False))
        while admission.running != 1:  # the holder is admitted (however long that takes here)
            assert not holder.done(), holder.result()
            await asyncio.sleep(0.01)
        ghost = await call_then_leave(app, {"model": "tiny", "prompt": "x", "max_tokens": 100, "seed": 2},
                                      False, leave_when=lambda: admission.queue_depth == 1)  # once queued
        assert ghost[0]["status"] == 499
        assert not holder.done()  # it left the queue while the holder ran, not when its turn came
        assert admission.queue_depth == 0 and admission.running == 1
        small = await call_then_leave(app, {"model": "tiny", "prompt": "x", "max_tokens": 5, "seed": 3},
                                      False, leave_when=lambda: False)
        assert small[0]["status"] == 200 and not holder.done()  # admitted beside the holder
        sent = await holder
        assert sent[0]["status"] == 200
        assert len(json.loads(sent[1]["body"])["choices"][0]["text"]) > 0

    asyncio.run(main())
    assert [call.requests[0].params.max_tokens for call in backend.calls] == [200, 5]  # the ghost never ran
    assert (admission.held, admission.running, admission.queue_depth) == (0, 0, 0)


@pytest.mark.parametrize("queued", [False, True])
def test_a_cancelled_admission_leaves_no_hold(queued):
    """The handler cancelled while its request is being admitted (server shutdown), at once or while it
    waits in the queue: nothing stays held, queued or running, and the next request is admitted."""
    from logprobe.api.serving.holding import Call, admit

    app = create_app(FakeBackend(TinyTokenizer()), Limits(max_tokens_in_flight=100), AdmissionSettings())
    admission = app.state.admission
    requests = [GenerationRequest("req_1", [256, 104], SamplingParams(max_tokens=50))]

    async def gone():
        await asyncio.sleep(30)

    def handler_request():
        return Call("req_1", "anonymous", gone=gone)

    async def main():
        blocker = await admission.acquire("anonymous", 60) if queued else None
        task = asyncio.ensure_future(admit(admission, handler_request(), requests))
        for _ in range(1 if not queued else 3):
            await asyncio.sleep(0)
        assert admission.queue_depth == (1 if queued else 0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled()
        if blocker is not None:
            admission.release(blocker, used=0)
        assert (admission.held, admission.running, admission.queue_depth) == (0, 0, 0)
        hold = await admit(admission, handler_request(), requests)  # the next one gets in at once
        assert admission.running == 1
        admission.release(hold, used=0)

    asyncio.run(main())


def test_abort_stops_a_request(slow):
    backend, _ = slow
    request = GenerationRequest("req_9", [256, 104], SamplingParams(max_tokens=200, seed=1))

    async def main():
        task = asyncio.ensure_future(backend.run([request]))
        await asyncio.sleep(0.05)
        backend.abort("req_9")
        with pytest.raises(RequestAborted, match="aborted"):
            await task

    asyncio.run(main())
    assert backend.aborted == ["req_9"] and backend.stats()["in_flight"] == 0


def without_ids(value):
    """An answer without its ids and times, which differ between any two answers."""
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items() if k not in ("id", "created", "created_at")}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


class StreamOnly:
    """A backend as the protocol declares it and no more: `run` is not there, so any path of the API that
    still asked for it would fail. Each member is written out (not found through `__getattr__`): from
    Python 3.12 on, a runtime-checkable protocol's isinstance looks attributes up statically."""

    def __init__(self, inner):
        self._inner = inner
        self.info, self.tokenizer, self.table = inner.info, inner.tokenizer, inner.table
        self.steps_here = inner.steps_here

    def stream(self, requests, k):
        return self._inner.stream(requests, k)

    def abort(self, request_id):
        return self._inner.abort(request_id)

    def stats(self):
        return self._inner.stats()

    def generated(self, request_id):
        return self._inner.generated(request_id)

    def observe(self, on_step, on_failure):
        return self._inner.observe(on_step, on_failure)

    def collector(self):
        return self._inner.collector()


def test_every_request_runs_through_the_backends_stream(tokenizer):
    """The backend's stream is the one way the API runs requests: an answer sent whole drains the stream
    without deltas (k None) to the outputs its end carries, a streamed one formats its deltas. Every
    endpoint, on a backend without `run`, answers as on the one with it, and the backend saw one stream a
    request (a choice list's scoring first)."""
    inner = FakeBackend(tokenizer, name="test/tiny-llama", aliases=("tiny",), num_layers=2, d_model=64,
                        context_length=256)
    backend = StreamOnly(inner)
    assert isinstance(backend, Backend)
    bodies = [
        ("/v1/completions", {"prompt": "Hello there", "max_tokens": 4, "logprobs": 2, "echo": True}),
        ("/v1/completions", {"prompt": "Pick:", "max_tokens": 2, "structured_outputs": {"choice": [" a", " b"]}}),
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 0}),  # nothing to compute: answered at once
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
        ("/v1/score", {"input": ["one text", "another text"]}),
        ("/v1/tree", {"prompt": "Once", "depth": 2, "branches": 2}),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 3}),
    ]
    with TestClient(create_app(inner, Limits())) as plain, TestClient(create_app(backend, Limits())) as only:
        for path, body in bodies:
            body = {"model": "tiny", **body, **({} if path in ("/v1/score", "/v1/tree") else {"temperature": 0})}
            expected, got = plain.post(path, json=body), only.post(path, json=body)
            assert got.status_code == expected.status_code == 200, (path, got.text)
            assert without_ids(got.json()) == without_ids(expected.json()), path
        kinds = [c.kind for c in inner.calls]
        assert set(kinds) == {"run"}, kinds  # the fake records a stream without deltas as "run"
        streamed = only.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 4,
                                                      "stream": True})
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
        assert inner.calls[-1].kind == "stream"
