"""A server that lives for days: what one request does must not change what later requests get.

Sequences, not single requests: a generation that grows the KV cache past its first length and then
more requests; a failing engine step and the requests after it; idle shrinks between bursts. Numbers
are checked against the float64 reference."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from faults import inject_failure
from fastapi.testclient import TestClient

from logprobe.api.app import create_app
from logprobe.config import Limits
from logprobe.engine.engine import Engine

TOL = 2e-5


@pytest.fixture(scope="module")
def long_model(tiny_model_factory, tokenizer):
    # a context of 1024 positions: the slot cache starts at 256 and must grow inside a decode step
    return tiny_model_factory(len(tokenizer), seed=3, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def long_engine(long_model, tokenizer):
    engine = Engine(long_model, tokenizer, "test/long", ["long"])
    assert type(engine.runner).__name__ == "LeanRunner"
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def long_client(long_engine):
    with TestClient(create_app(long_engine, Limits()), raise_server_exceptions=False) as c:
        yield c


def greedy(client, prompt, max_tokens, model="long", **extra):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1, **extra}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def check_against_reference(reference, prompt_ids, choice, tokenizer, positions=None):
    """Greedy tokens are the reference's likeliest, their log probabilities the reference's (at the
    given positions, all by default)."""
    ids = [tokenizer.convert_tokens_to_ids(t) if not t.startswith("token_id:") else int(t[9:])
           for t in choice["logprobs"]["tokens"]]
    ref = reference.logprobs(prompt_ids + ids).numpy()
    for i in positions if positions is not None else range(len(ids)):
        row = ref[len(prompt_ids) - 1 + i]
        assert choice["logprobs"]["token_logprobs"][i] == pytest.approx(row[ids[i]], abs=TOL)
        assert row[ids[i]] >= row.max() - TOL  # the likeliest (up to float32 ties)


def test_generation_past_the_caches_first_length_then_more_requests(long_client, long_engine, long_model,
                                                                    tokenizer, reference_of):
    """The reported bug: a 300-token generation grew the KV cache inside a decode step (inference mode);
    the next request's prompt could not be written into it, and every later generation answered 500."""
    cache = long_engine.runner.cache
    assert list(long_engine.kv.classes) == list(cache.slabs) == [256]  # one size class, of the first capacity
    reference = reference_of(long_model)
    short = greedy(long_client, [5, 6, 7], 5, return_tokens_as_token_ids=True)
    classes = []  # the largest size class after each engine step
    long_engine.step_observer = lambda seconds, rows: classes.append(max(cache.slabs))
    try:
        long = greedy(long_client, [5, 6, 7], 300, return_tokens_as_token_ids=True)
    finally:
        long_engine.step_observer = None
    assert len(long["logprobs"]["tokens"]) == 300
    assert max(classes) == 512  # it grew inside a decode step: the row moved into the next class
    for n in range(3):  # every later request, long or short, still works and is still right
        again = greedy(long_client, [5, 6, 7], 5, return_tokens_as_token_ids=True)
        assert again["logprobs"] == short["logprobs"]
        other = greedy(long_client, [9, 8, 7, 6], 40 + 100 * n, return_tokens_as_token_ids=True)
        check_against_reference(reference, [9, 8, 7, 6], other, tokenizer, positions=[0, 1, 20, 39])
    check_against_reference(reference, [5, 6, 7], long, tokenizer, positions=[0, 1, 100, 255, 256, 299])
    health = long_client.get("/health").json()
    assert health["status"] == "ready" and health["engine_failures"] == {"steps": 0, "requests": 0}


def test_cache_grows_and_shrinks_many_times(long_client, long_engine):
    """Idle shrinks between bursts, growth again in the next: answers never change."""
    cache = long_engine.runner.cache
    initial = [(256, 4)]  # (capacity, slots) of each size class
    # float32 keys and values of the positions the 256 class holds (256, or 512 where the CPU's attention
    # kernel splits a last block of 256 keys: Attention.held)
    per_slot = 2 * cache.num_layers * cache.kv_heads * cache.positions(256) * cache.head_dim * 4

    def classes():  # the memory's, which follows the manager's
        return [(capacity, slab.num_slots) for capacity, slab in cache.slabs.items()]

    want = None
    for _ in range(3):
        largest = []  # the largest size class after each engine step
        long_engine.step_observer = lambda seconds, rows: largest.append(max(cache.slabs))
        try:
            out = greedy(long_client, [11, 12], 270, return_tokens_as_token_ids=True)
        finally:
            long_engine.step_observer = None
        assert max(largest) > 256
        want = want or out["logprobs"]
        assert out["logprobs"] == want
        deadline = time.time() + 10
        while classes() != initial and time.time() < deadline:  # the engine shrinks it when idle
            time.sleep(0.05)
        assert classes() == initial and cache.nbytes == 4 * per_slot


def metric(client, name):
    text = client.get("/metrics").text
    m = re.search(r"^" + re.escape(name) + r" ([0-9.e+]+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def wait_health(client, status, seconds=300):
    """/health's body once it says `status` (the engine's self-check runs after its idle wait; the deadline
    only bounds a test that would otherwise hang, it is no budget a loaded machine must meet)."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        body = client.get("/health").json()
        if body["status"] == status:
            return body
        time.sleep(0.05)
    raise AssertionError(f"/health never said {status}: {body}")


@pytest.fixture()
def fresh(long_model, tokenizer):
    engine = Engine(long_model, tokenizer, "test/long", ["long"])
    engine.start()
    with TestClient(create_app(engine, Limits()), raise_server_exceptions=False) as c:
        yield engine, c
    engine.stop()


def test_a_failed_step_fails_its_requests_resets_and_recovers(fresh, monkeypatch):
    engine, client = fresh
    want = greedy(client, [5, 6, 7], 6)
    inject_failure(monkeypatch, engine.runner, "decode_and_pick", 2, RuntimeError("injected fault in a shared pass"))
    r = client.post("/v1/completions", json={"model": "long", "prompt": [5, 6, 7], "max_tokens": 6,
                                             "temperature": 0})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert "injected" not in r.text  # no internals
    # the engine rebuilt its cache and its self-check (a step that succeeds) makes it ready again
    body = wait_health(client, "ready")
    assert body["engine_failures"]["steps"] == 1 and body["last_error"]["type"] == "RuntimeError"
    while engine.num_in_flight:  # "ready" comes with the self-check's first step; it holds a row until its last
        time.sleep(0.01)
    assert engine.kv.rows == () and engine.runner.is_consistent(engine.scheduler.running)
    assert greedy(client, [5, 6, 7], 6) == want
    assert metric(client, 'logprobe_engine_failures_total{kind="step"}') == 1
    assert engine.num_in_flight == 0


def test_a_kv_memory_operation_that_fails_part_way_is_a_failed_step_and_later_answers_keep_their_bits(
        fresh, monkeypatch):
    """The KV cache manager has decided a row's move into the next size class, and the runner's memory runs
    out while making that class (an out-of-memory in `KVMemory`): the step's request fails (500), the
    manager and the memory start afresh, and the same 270-token generation afterwards has the bits it had
    before the failure, its row crossing the same class boundary."""
    engine, client = fresh
    want = greedy(client, [5, 6, 7], 270, return_tokens_as_token_ids=True)
    memory = engine.runner.cache
    real = memory._alloc
    failed = []

    def alloc(op):
        if op.capacity > 256 and not failed:
            failed.append(op)
            raise MemoryError("injected: no memory for a larger size class")
        real(op)

    monkeypatch.setattr(memory, "_alloc", alloc)
    r = client.post("/v1/completions", json={"model": "long", "prompt": [5, 6, 7], "max_tokens": 270,
                                             "temperature": 0})
    assert failed and r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert "injected" not in r.text
    monkeypatch.undo()
    body = wait_health(client, "ready")
    assert body["engine_failures"]["steps"] == 1 and body["last_error"]["type"] == "MemoryError"
    while engine.num_in_flight:  # the self-check holds a row until its last step
        time.sleep(0.01)
    assert engine.kv.rows == () and engine.runner.cache.matches(engine.kv)
    assert greedy(client, [5, 6, 7], 270, return_tokens_as_token_ids=True) == want


def test_a_broken_engine_says_so(fresh, monkeypatch):
    """When every step fails, /health answers 503 "failing" with the error's class, not "ready"."""
    engine, client = fresh

    def broken(chunks):
        raise ValueError("injected persistent fault")

    monkeypatch.setattr(engine.runner, "prefill_chunks", broken)
    r = client.post("/v1/completions", json={"model": "long", "prompt": [5, 6], "max_tokens": 3})
    assert r.status_code == 500
    deadline = time.monotonic() + 300
    while (r := client.get("/health")).json()["engine_failures"]["steps"] < 2 and time.monotonic() < deadline:
        time.sleep(0.1)  # past the idle wait, the self-check runs, and fails too
    assert r.status_code == 503
    body = r.json()
    assert body["status"] == "failing" and body["last_error"]["type"] == "ValueError"
    assert body["engine_failures"]["steps"] >= 2  # the request's step and the self-check's
    monkeypatch.undo()  # fixed (in real life: a restart); the next request's success clears it
    assert greedy(client, [5, 6], 3)["finish_reason"] == "length"
    assert client.get("/health").json()["status"] == "ready"


def test_inconsistent_cache_after_a_request_failure_is_rebuilt(fresh, monkeypatch):
    """A per-request failure that leaves the shared cache out of step (here: a row vanishes) is caught
    after the step, the cache rebuilt and the other requests in it failed, never served wrong."""
    engine, client = fresh
    real = engine.runner.expand

    def losing_expand(group, rows, ops):
        real(group, rows, ops)
        engine.kv.classes[rows[-1].slab].rows.pop()  # corrupt the shared bookkeeping

    monkeypatch.setattr(engine.runner, "expand", losing_expand)
    r = client.post("/v1/completions", json={"model": "long", "prompt": [5, 6], "max_tokens": 5})
    assert r.status_code == 500
    monkeypatch.undo()
    wait_health(client, "ready")
    assert engine.health["step_failures"] == 1
    assert len(greedy(client, [5, 6], 5)["logprobs"]["tokens"]) == 5


def test_hf_runner_uses_this_transformers_cache_keyword(tiny_model, tokenizer):
    """The transformers path passes its KV cache under the name this version reads, and a name the
    decoder ignores (swallowed by **kwargs) fails loudly instead of giving wrong numbers."""
    from logprobe.engine.host.request import SamplingParams, SequenceGroup
    from logprobe.engine.runners.model_runner import CacheIgnored, ModelRunner
    from logprobe.tokens import TokenTable
    import inspect

    runner = ModelRunner(tiny_model)
    assert runner.cache_kw in inspect.signature(runner.decoder.forward).parameters
    table = TokenTable.build(tokenizer, len(tokenizer))
    group = SequenceGroup("t", [5, 6, 7, 8], SamplingParams(max_tokens=2), table)
    runner.prefill(group)
    assert runner.caches[group].get_seq_length() == 4
    runner.decode(group, [9])
    assert runner.caches[group].get_seq_length() == 5
    runner.cache_kw = "a_keyword_nobody_reads"
    with pytest.raises(CacheIgnored):
        runner.prefill(SequenceGroup("t", [5, 6], SamplingParams(max_tokens=2), table))


def test_engine_on_transformers_path_generates_long_then_more(tiny_model_factory, tokenizer, reference_of):
    """The transformers forward (every non-Llama model) across a sequence of requests, against float64."""
    model = tiny_model_factory(len(tokenizer), seed=4, max_position_embeddings=512)
    reference = reference_of(model)
    engine = Engine(model, tokenizer, "test/hf", ["hf"], fast=False)
    engine.start()
    try:
        with TestClient(create_app(engine, Limits()), raise_server_exceptions=False) as c:
            for prompt, n in (([5, 6, 7], 5), ([5, 6, 7], 300), ([3, 4], 20)):
                out = greedy(c, prompt, n, model="hf", return_tokens_as_token_ids=True)
                check_against_reference(reference, prompt, out, tokenizer,
                                        positions=sorted({0, 1, n // 2, n - 1}))
    finally:
        engine.stop()
    np.testing.assert_equal(engine.health["step_failures"], 0)


def test_whole_vocabulary_rows_and_activations_are_let_go_after_the_answer(client):
    """Answered records can outlive their response in reference cycles (anyio's and Starlette's
    exception tracebacks hold frames that hold them) until a rare full garbage collection: the large
    arrays in them are dropped once the body is written, so each whole-vocabulary answer does not leave
    hundreds of MB behind. The collector is paused here, as between its full passes in a server."""
    import gc

    from logprobe.backend import ChoiceOutput, PromptColumns

    def held():
        # type() rather than isinstance(): isinstance reads __class__, which some module stand-ins in
        # gc's list answer with a deprecation warning
        return {id(o) for o in gc.get_objects()
                if (type(o) is PromptColumns and o.full is not None)
                or (type(o) is ChoiceOutput and o.residual is not None)}

    gc.collect()
    before = held()
    gc.disable()
    try:
        bodies = [{"prompt": "one two three four", "max_tokens": 0, "prompt_logprobs": -1},
                  {"prompt": "one two three four", "max_tokens": 0, "prompt_logprobs": -1, "vocab_encoding": "float32"},
                  {"prompt": "one two", "max_tokens": 2, "prompt_logprobs": -1, "n": 2,
                   "output_residual_stream": [0, 1]},
                  {"prompt": "one two", "max_tokens": 3, "output_residual_stream": [1]}]
        for body in bodies:
            r = client.post("/v1/completions", json={"model": "tiny", **body})
            assert r.status_code == 200
            choice = r.json()["choices"][0]
            assert choice.get("prompt_logprobs") or choice.get("residual_stream")
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 2, "prompt_logprobs": -1})
        assert r.status_code == 200 and len(r.json()["prompt_logprobs"]) > 2
        assert held() - before == set()
    finally:
        gc.enable()
