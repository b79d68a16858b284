"""Steering on the engine, on both runners, against a float64 forward of the same weights: `logit_bias`,
`allowed_token_ids`, bad words and a grammar (a test double that allows digits) shape the processed
distribution, never the raw one; the processed numbers are the reference's with the bias added and
renormalised over the allowed tokens, then filtered; `constraint_logprobs` is log sum of the raw
probabilities of the allowed tokens. Plain requests batched with steered ones answer bit for bit as
beside unsteered twins."""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest

from logprobe.engine.engine import Engine
from logprobe.engine.host.request import SamplingParams, SequenceGroup
from logprobe.backend import Constraint, RequestConflict

TOL = 4e-5  # as test_instruments_reference.py (the same sharp model), plus a relative 1e-5
PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def sharp_model(tokenizer, tiny_model_factory):
    return tiny_model_factory(len(tokenizer), seed=3, initializer_range=0.5)


@pytest.fixture(scope="module")
def sharp_reference(sharp_model, reference_of):
    return reference_of(sharp_model)


@pytest.fixture(scope="module")
def runner_model(sharp_model):
    """The model `engine` (tests/conftest.py) runs on both runners."""
    return sharp_model


def run(engine, *groups):
    asyncio.run(engine.run_groups(list(groups)))
    for g in groups:
        if g.error is not None:
            raise g.error
    return [g.output() for g in groups]


def run_together(engine, *groups, may_fail=False):
    """`run`, with every group entering the engine at the same step whatever the machine's speed: a
    gate request holds the engine thread (in its step callback) until all of them are queued. With
    `may_fail`, a group's error stays on the group (`group.error`) instead of being raised."""
    entered, release = threading.Event(), threading.Event()
    gate = group(engine, "Gate", max_tokens=1, temperature=0)

    def hold(_):
        entered.set()
        release.wait()

    gate.on_step = hold

    async def go():
        waiting = engine.submit([gate])
        while not entered.is_set():
            await asyncio.sleep(0.001)
        futures = engine.submit(list(groups))
        release.set()
        await asyncio.gather(*waiting, *futures, return_exceptions=may_fail)

    asyncio.run(go())
    return [g.output() for g in groups if g.error is None]


def group(engine, prompt=PROMPT, **params):
    ids = engine.tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
    return SequenceGroup("t", ids, SamplingParams(**params), engine.table)


def reference_rows(reference, engine, prompt, token_ids) -> np.ndarray:
    """Float64 rows of the distributions the choice's tokens were drawn at."""
    ids = engine.tokenizer(prompt).input_ids
    rows = reference.logprobs(list(ids) + [int(t) for t in token_ids]).numpy()
    return rows[len(ids) - 1:len(ids) - 1 + len(token_ids)]


def processed_reference(row, bias=None, allowed=None, temperature=1.0, top_k=-1, top_p=1.0) -> np.ndarray:
    """The distribution a steered token is drawn from, in float64, written from the API's description:
    the bias added to the raw log probabilities, the disallowed tokens out, then temperature, top-k,
    top-p, renormalised; a point mass at the largest score for temperature 0."""
    scores = row.copy()
    if bias:
        for token, value in bias:
            scores[token] += value
    if allowed is not None:
        scores[~allowed] = -np.inf
    if temperature < 1e-5:
        out = np.full(row.shape, -np.inf)
        out[np.argmax(scores)] = 0.0
        return out
    scores = (scores - scores.max()) / temperature
    if 0 < top_k < len(row):
        kth = np.sort(scores)[::-1][top_k - 1]
        scores = np.where(scores < kth, -np.inf, scores)
    if top_p < 1:
        order = np.argsort(-scores, kind="stable")
        probs = np.exp(scores[order])
        probs /= probs.sum()
        drop = np.cumsum(probs) - probs >= top_p
        drop[0] = False
        scores[order[drop]] = -np.inf
    finite = np.isfinite(scores)
    out = np.full(row.shape, -np.inf)
    out[finite] = scores[finite] - np.log(np.exp(scores[finite]).sum())
    return out


def logsumexp(values: np.ndarray) -> float:
    top = values.max()
    return float(top + np.log(np.exp(values - top).sum()))


def assert_same_numbers(got, want, tol=TOL):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert np.array_equal(np.isneginf(got), np.isneginf(want)), (got, want)
    finite = ~np.isneginf(want)
    np.testing.assert_allclose(got[finite], want[finite], atol=tol, rtol=1e-5)


def assert_top_k(ids, values, dist, tol=TOL):
    """`ids`/`values` are the k likeliest of `dist` (float64), likeliest first, up to ties within tol."""
    assert_same_numbers(values, dist[ids], tol)
    finite = values[np.isfinite(values)]
    assert np.all(np.diff(finite) <= tol)
    if len(finite):
        kth = np.sort(dist)[::-1][len(finite) - 1]
        assert finite.min() >= kth - tol
    assert len(set(ids[np.isfinite(values)].tolist())) == len(finite)


def test_logit_bias_raw_and_processed(engine, sharp_reference):
    """Both modes from one request: raw is the model's (ids and values), processed the reference with
    the bias added then temperature and top-k, with its own top-k list."""
    probe, = run(engine, group(engine, max_tokens=1, temperature=0, logprobs=3))
    favourite = int(probe.choices[0].token_ids[0])
    bias = ((favourite, -100.0), (330, 6.0), (389, 4.5), (17, -2.0))
    params = dict(max_tokens=5, n=2, seed=7, temperature=0.8, top_k=20, logprobs=5, logit_bias=bias)
    both, = run(engine, group(engine, **params, logprobs_mode="both"))
    processed, = run(engine, group(engine, **params, logprobs_mode="processed"))
    raw, = run(engine, group(engine, **params))
    tol = TOL / 0.8
    for b, p, r in zip(both.choices, processed.choices, raw.choices):
        assert np.array_equal(b.token_ids, p.token_ids) and np.array_equal(b.token_ids, r.token_ids)
        assert b.constraint_logprobs is None  # a bias masks nothing
        rows = reference_rows(sharp_reference, engine, PROMPT, b.token_ids)
        for i, token in enumerate(b.token_ids):
            row = rows[i]
            dist = processed_reference(row, bias, temperature=0.8, top_k=20)
            assert np.isfinite(dist[token])
            assert_same_numbers([b.logprobs[i], r.logprobs[i]], [row[token]] * 2)  # raw: no bias
            assert_top_k(b.top_ids[i], b.top_logprobs[i], row)
            assert_same_numbers([b.processed_logprobs[i], p.logprobs[i]], [dist[token]] * 2, tol)
            assert_top_k(b.processed_top_ids[i], b.processed_top_logprobs[i], dist, tol)
            np.testing.assert_array_equal(p.top_ids[i], b.processed_top_ids[i])
            np.testing.assert_array_equal(p.top_logprobs[i], b.processed_top_logprobs[i])
        assert favourite not in b.token_ids[:1]  # -100 bans it
    # the bias reorders: the processed top-k is not the raw one
    assert any(not np.array_equal(c.top_ids[0], c.processed_top_ids[0]) for c in both.choices)


def test_allowed_token_ids(engine, sharp_reference):
    allowed_ids = (330, 389, 17, 1000, 2000, 49151)
    allowed = np.zeros(engine.info.vocab_size, dtype=bool)
    allowed[list(allowed_ids)] = True
    params = dict(max_tokens=4, n=3, seed=3, temperature=1.0, top_p=0.9, logprobs=4, allowed_token_ids=allowed_ids,
                  logprobs_mode="both")
    out, = run(engine, group(engine, **params))
    for choice in out.choices:
        assert set(choice.token_ids.tolist()) <= set(allowed_ids)
        rows = reference_rows(sharp_reference, engine, PROMPT, choice.token_ids)
        for i, token in enumerate(choice.token_ids):
            row = rows[i]
            dist = processed_reference(row, allowed=allowed, top_p=0.9)
            assert_same_numbers([choice.logprobs[i]], [row[token]])
            assert_top_k(choice.top_ids[i], choice.top_logprobs[i], row)
            assert_same_numbers([choice.processed_logprobs[i]], [dist[token]])
            assert_top_k(choice.processed_top_ids[i], choice.processed_top_logprobs[i], dist)
            assert set(choice.processed_top_ids[i][np.isfinite(choice.processed_top_logprobs[i])]) <= set(allowed_ids)
            assert choice.constraint_logprobs[i] == pytest.approx(logsumexp(row[allowed]), abs=TOL, rel=1e-5)
            assert choice.constraint_logprobs[i] < 0


def test_bad_words(engine, sharp_reference):
    """A one-token bad word is never drawn; a two-token one only after its first token (greedy runs,
    so the reference says which token comes instead). constraint_logprobs is exactly 0 where nothing
    was masked."""
    stop = engine.info.stop_token_ids
    plain, = run(engine, group(engine, max_tokens=4, temperature=0, logprobs=1, stop_token_ids=stop))
    a, b = (int(t) for t in plain.choices[0].token_ids[:2])
    out, = run(engine, group(engine, max_tokens=4, temperature=0, logprobs=1, bad_words_ids=((a, b), (12345,)),
                             stop_token_ids=stop))
    choice = out.choices[0]
    assert int(choice.token_ids[0]) == a and int(choice.token_ids[1]) != b
    rows = reference_rows(sharp_reference, engine, PROMPT, choice.token_ids)
    for i, token in enumerate(choice.token_ids):
        allowed = np.ones(engine.info.vocab_size, dtype=bool)
        allowed[12345] = False
        if i > 0 and int(choice.token_ids[i - 1]) == a:
            allowed[b] = False
        ref_token = int(np.argmax(np.where(allowed, rows[i], -np.inf)))
        assert rows[i][token] >= rows[i][ref_token] - TOL  # greedy over the allowed tokens
        assert choice.constraint_logprobs[i] == pytest.approx(logsumexp(rows[i][allowed]), abs=TOL, rel=1e-5)
        assert_same_numbers([choice.logprobs[i]], [rows[i][token]])
    out, = run(engine, group(engine, max_tokens=3, temperature=0, logprobs=0, bad_words_ids=((a,),),
                             stop_token_ids=stop))
    assert int(out.choices[0].token_ids[0]) != a
    # a word that never comes up: nothing is masked anywhere
    out, = run(engine, group(engine, max_tokens=3, temperature=0, logprobs=0, bad_words_ids=((5, 6),)))
    assert out.choices[0].constraint_logprobs.tolist() == [0.0, 0.0, 0.0]


def test_seeded_draws_under_bias_repeat(engine):
    """The same seed and bias draw the same tokens, alone or batched with other requests."""
    params = dict(max_tokens=6, n=2, seed=99, temperature=1.2, logit_bias=((330, 3.0), (389, 3.0)),
                  allowed_token_ids=tuple(range(300, 400)))
    first, = run(engine, group(engine, **params))
    again, = run(engine, group(engine, **params))
    batched = run(engine, group(engine, "Other words", max_tokens=5, seed=1), group(engine, **params))[1]
    for x, y, z in zip(first.choices, again.choices, batched.choices):
        assert x.token_ids.tolist() == y.token_ids.tolist() == z.token_ids.tolist()
        assert set(x.token_ids.tolist()) <= set(range(300, 400))


PLAIN = [dict(max_tokens=6, n=2, seed=21, logprobs=3, temperature=0.8, top_p=0.9),
         dict(max_tokens=4, temperature=0, logprobs=1, echo=True)]
STEERED = dict(max_tokens=5, n=2, seed=5, logprobs=2, temperature=0.9, logit_bias=((330, 2.0),),
               allowed_token_ids=tuple(range(200, 600)), bad_words_ids=((330, 331),))
STEERING = ("logit_bias", "allowed_token_ids", "bad_words_ids")


def answers(outs):
    return [[(c.token_ids.tobytes(), c.logprobs.tobytes(), c.top_ids.tobytes(), c.top_logprobs.tobytes(), c.text)
             for c in out.choices] for out in outs]


def test_plain_answers_unchanged_beside_steered(engine):
    """Bit for bit, across batches of the same shape whose last request is steered or its unsteered
    twin; and before and after a steered request."""
    prompts = ["Once upon a time", "A somewhat longer prompt for the batch"]
    twin = {k: v for k, v in STEERED.items() if k not in STEERING}

    def batch(other):
        return [group(engine, p, **params) for p, params in zip(prompts, PLAIN)] + [group(engine, "Other", **other)]

    before = answers(run_together(engine, *batch(twin)))
    mixed = run_together(engine, *batch(STEERED))
    assert answers(mixed[:2]) == before[:2]
    assert all(set(c.token_ids.tolist()) <= set(range(200, 600)) for c in mixed[2].choices)
    alone = answers(run_together(engine, *[group(engine, p, **params) for p, params in zip(prompts, PLAIN)]))
    run(engine, group(engine, "Other", **STEERED))
    assert answers(run_together(engine, *[group(engine, p, **params) for p, params in zip(prompts, PLAIN)])) == alone


def test_a_conflict_fails_its_request_only(engine):
    """Requests whose masks leave no token (at the first token, picked after the prompt's pass; at the
    second, in a shared decode step) fail with the conflict, naming their fields; the plain and steered
    requests of the same steps answer as without them, and the engine counts no failure."""
    prompts = ["Once upon a time", "A somewhat longer prompt for the batch"]
    failures = (engine.step_failures, engine.request_failures, engine.last_error)

    def others():
        return [group(engine, p, **params) for p, params in zip(prompts, PLAIN)] + [group(engine, "Other", **STEERED)]

    first = group(engine, "Other", max_tokens=3, allowed_token_ids=(330,), bad_words_ids=((330,),))
    second = group(engine, "Other", max_tokens=3, n=2, allowed_token_ids=(330,), bad_words_ids=((330, 330),))
    mixed = others()
    run_together(engine, *mixed, first, second, may_fail=True)
    assert isinstance(first.error, RequestConflict) and isinstance(second.error, RequestConflict)
    assert "'allowed_token_ids' and 'bad_words' together allow no token at generated token 1" in first.error.message
    assert "at generated token 2" in second.error.message and second.error.param == "allowed_token_ids"
    assert all(g.error is None for g in mixed)
    alone = run_together(engine, *others())
    for got, want in zip([g.output() for g in mixed], alone):
        for a, b in zip(got.choices, want.choices):
            assert a.token_ids.tolist() == b.token_ids.tolist() and a.text == b.text
            assert_same_numbers(a.logprobs, b.logprobs)
    assert (engine.step_failures, engine.request_failures, engine.last_error) == failures


class DigitGrammar:
    """A test double of engine/host/grammar.py's GrammarState: up to `length` digit tokens, then the end."""

    def __init__(self, digits: np.ndarray, stop_ids, length: int = 3):
        self.digits, self.stop_ids, self.length, self.taken = digits, sorted(stop_ids), length, []
        self.threads = set()

    def allowed(self) -> np.ndarray:
        import threading

        self.threads.add(threading.current_thread().name)
        if len(self.taken) >= self.length:
            out = np.zeros_like(self.digits)
            out[self.stop_ids] = True
            return out
        return self.digits.copy()

    def sets(self) -> tuple[np.ndarray, None]:
        return self.allowed(), None  # every allowed token may be drawn

    def advance(self, token: int) -> None:
        if not self.allowed()[token]:
            raise ValueError(f"token {token} is not allowed")
        self.taken.append(token)

    @property
    def is_accepting(self) -> bool:
        return len(self.taken) >= self.length


def test_grammar_double(engine, sharp_reference):
    """A constrained request's tokens follow its grammar state (made per choice when it starts,
    advanced after each token, its masks computed on the grammar thread while the forward pass runs);
    complete and allowing only the end, it ends with "stop"."""
    digits = np.zeros(engine.info.vocab_size, dtype=bool)
    for token, text in enumerate(engine.table.strings[:len(engine.tokenizer)]):
        digits[token] = text.isdigit()
    states = []

    def new_state(constraint):
        assert constraint.kind == "regex"
        states.append(DigitGrammar(digits, engine.info.stop_token_ids))
        return states[-1]

    engine.new_grammar_state = new_state
    try:
        out, = run(engine, group(engine, "Numbers:", max_tokens=10, n=2, seed=4, logprobs=2, logprobs_mode="both",
                                 constraint=Constraint("regex", "[0-9]{3}"), stop_token_ids=engine.info.stop_token_ids))
    finally:
        del engine.new_grammar_state
    assert len(states) == 2 and any(name.startswith("logprobe-grammar") for s in states for name in s.threads)
    for choice in out.choices:
        assert choice.finish_reason == "stop" and len(choice.token_ids) == 4
        assert all(digits[t] for t in choice.token_ids[:3]) and int(choice.token_ids[3]) in engine.info.stop_token_ids
        rows = reference_rows(sharp_reference, engine, "Numbers:", choice.token_ids)
        for i, token in enumerate(choice.token_ids):
            allowed = digits if i < 3 else np.isin(np.arange(len(digits)), sorted(engine.info.stop_token_ids))
            assert_same_numbers([choice.logprobs[i]], [rows[i][token]])
            assert_same_numbers([choice.processed_logprobs[i]], [processed_reference(rows[i], allowed=allowed)[token]])
            assert choice.constraint_logprobs[i] == pytest.approx(logsumexp(rows[i][allowed]), abs=TOL, rel=1e-5)


def test_over_http(client, reference, tiny_engine):
    """The numbers as the API writes them (completions, both modes, and the same request streamed in
    the processed mode), from the session's engine, against its reference."""
    ids = tiny_engine.tokenizer("Answer: A or B").input_ids
    allowed_ids = [330, 389, 17, 300, 301, 302]
    allowed = np.zeros(tiny_engine.info.vocab_size, dtype=bool)
    allowed[allowed_ids] = True
    bias = {"330": 1.5, "389": -3}
    body = {"model": "tiny", "prompt": ids, "max_tokens": 3, "seed": 2, "temperature": 0.7, "logprobs": 2, "n": 2,
            "logit_bias": bias, "allowed_token_ids": allowed_ids, "return_tokens_as_token_ids": True}
    r = client.post("/v1/completions", json={**body, "logprobs_mode": "both"})
    assert r.status_code == 200, r.text
    streamed = client.post("/v1/completions", json={**body, "logprobs_mode": "processed", "stream": True})
    assert streamed.status_code == 200, streamed.text
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    streamed_both = client.post("/v1/completions", json={**body, "logprobs_mode": "both", "stream": True})
    chunks_both = [json.loads(line[6:]) for line in streamed_both.text.splitlines() if line.startswith("data: {")]
    for choice in r.json()["choices"]:
        raw, processed = choice["logprobs"], choice["processed_logprobs"]
        generated = [int(t.split(":")[1]) for t in raw["tokens"]]
        assert set(generated) <= set(allowed_ids) and processed["tokens"] == raw["tokens"]
        rows = reference.logprobs(ids + generated).numpy()[len(ids) - 1:]
        for i, token in enumerate(generated):
            dist = processed_reference(rows[i], [(int(t), b) for t, b in bias.items()], allowed, temperature=0.7)
            assert raw["token_logprobs"][i] == pytest.approx(rows[i][token], abs=TOL)
            assert processed["token_logprobs"][i] == pytest.approx(dist[token], abs=TOL / 0.7)
            for name, value in processed["top_logprobs"][i].items():  # the processed distribution's own top-k
                assert value == pytest.approx(dist[int(name.split(":")[1])], abs=TOL / 0.7)
            for name, value in raw["top_logprobs"][i].items():
                assert value == pytest.approx(rows[i][int(name.split(":")[1])], abs=TOL)
            assert choice["constraint_logprobs"][i] == pytest.approx(logsumexp(rows[i][allowed]), abs=TOL)
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert sum((c["logprobs"]["tokens"] for c in mine), []) == raw["tokens"]
        assert sum((c["logprobs"]["token_logprobs"] for c in mine), []) == processed["token_logprobs"]
        assert sum((c["logprobs"]["top_logprobs"] for c in mine), []) == processed["top_logprobs"]
        assert sum((c["constraint_logprobs"] for c in mine), []) == choice["constraint_logprobs"]
        mine = [c["choices"][0] for c in chunks_both if c["choices"][0]["index"] == choice["index"]]
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            assert sum((c["logprobs"][key] for c in mine), []) == raw[key]
            assert sum((c["processed_logprobs"][key] for c in mine), []) == processed[key]


def test_chat_over_http(client, reference, tiny_engine):
    """Chat with bad words: the words never appear, and `constraint_logprobs` lists one value per
    `logprobs.content` entry; a plain chat has no such field."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Say the the the"}], "max_tokens": 6,
            "temperature": 0, "logprobs": True, "top_logprobs": 1}
    plain = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert "constraint_logprobs" not in plain
    first = plain["logprobs"]["content"][0]["token"]
    r = client.post("/v1/chat/completions", json={**body, "bad_words": [first]})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert len(choice["constraint_logprobs"]) == len(choice["logprobs"]["content"])
    assert choice["logprobs"]["content"][0]["token"] != first
    assert all(v <= 0 for v in choice["constraint_logprobs"]) and choice["constraint_logprobs"][0] < 0


class BrokenGrammar(DigitGrammar):
    """Fails on the grammar thread once it has taken a token."""

    def allowed(self) -> np.ndarray:
        if self.taken:
            raise RuntimeError("grammar broke")
        return super().allowed()


def test_a_failing_grammar_fails_its_request_only(engine):
    digits = np.zeros(engine.info.vocab_size, dtype=bool)
    digits[[int(t) for t in engine.tokenizer("0123456789", add_special_tokens=False).input_ids]] = True
    engine.new_grammar_state = lambda constraint: BrokenGrammar(digits, engine.info.stop_token_ids)
    try:
        broken = group(engine, "Numbers:", max_tokens=5, constraint=Constraint("regex", "[0-9]+"))
        neighbour = group(engine, max_tokens=6, temperature=0)

        async def both():
            return await asyncio.gather(*engine.submit([broken, neighbour]), return_exceptions=True)

        asyncio.run(both())
    finally:
        del engine.new_grammar_state
    assert isinstance(broken.error, RuntimeError) and "grammar broke" in str(broken.error)
    assert neighbour.error is None and len(neighbour.output().choices[0].token_ids) == 6
    alone, = run(engine, group(engine, max_tokens=6, temperature=0))
    assert neighbour.output().choices[0].token_ids.tolist() == alone.choices[0].token_ids.tolist()


def test_a_stopped_engine_leaves_no_grammar_thread(sharp_model, tokenizer):
    """The grammar worker starts with the first constrained step and ends when its engine stops: engines
    made and stopped per model load, or per test, leave no thread behind. Started again, the engine
    serves as before, with a worker of its own again."""
    def grammar_threads():
        return {t for t in threading.enumerate() if t.name.startswith("logprobe-grammar") and t.is_alive()}

    before = grammar_threads()
    engine = Engine(sharp_model, tokenizer, "test/sharp", [])
    answers = []
    for attempt in range(2):
        engine.start()
        try:
            out, = run(engine, group(engine, "Numbers:", max_tokens=4, temperature=0, logprobs=1,
                                     constraint=Constraint("regex", "[0-9]{4}")))
            assert all(engine.table.strings[t].isdigit() for t in out.choices[0].token_ids)
            assert grammar_threads() - before, "the constrained step ran on the grammar thread"
            answers.append((list(out.choices[0].token_ids), list(out.choices[0].logprobs)))
        finally:
            engine.stop()
        for thread in grammar_threads() - before:
            thread.join(timeout=60)  # generous: the worker only has to see the shutdown
        assert not grammar_threads() - before, f"start {attempt + 1}: a grammar thread outlived its engine"
    assert answers[0] == answers[1]
