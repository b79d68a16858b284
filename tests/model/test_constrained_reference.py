"""Constrained decoding against the float64 forward of the same weights: under a `choice` list, a
digits regex and a small JSON schema, every generated position's raw numbers are the reference's, its
processed numbers are the reference renormalised over the allowed set, and `constraint_logprobs` is
log Σ of the reference over that set, where the allowed set is computed here from the tokens' bytes
alone (which tokens keep the text a prefix of a valid text, or inside [0-9]*; under a choice list,
decided before generation, the drawn answer's next token). 200 seeded samples
under the schema validate with jsonschema, and their first tokens follow the processed distribution.
/v1/score under a constraint: each position's allowed mass and constrained log probability."""

from __future__ import annotations

import json
import math
import os
import re

import jsonschema
import numpy as np
import pytest

TOL = 1e-5
NEG_INF_WIRE = -9999.0
MODEL = "tiny"
CHOICES = ["yes", "no", "maybe so"]
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}}, "required": ["answer"],
          "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
# Without whitespace, the schema's texts are these three: its allowed sets are those of a choice list.
SCHEMA_TEXTS = ['{"answer":"%s"}' % value for value in SCHEMA["properties"]["answer"]["enum"]]


def post(client, path="/v1/completions", **body):
    body.setdefault("model", MODEL)
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def stop_ids(engine) -> set[int]:
    return {engine.info.eos_token_id} | set(engine.info.stop_token_ids)


def text_tokens(engine) -> list[tuple[int, bytes]]:
    table = engine.table
    return [(i, b) for i, b in enumerate(table.token_bytes) if b and i not in table.special_ids]


def prefix_allowed(engine, texts: list[str], prefix: bytes) -> np.ndarray:
    """Tokens after which the text is still a prefix of one of `texts`; the stop tokens where it is one."""
    whole = [t.encode() for t in texts]
    out = np.zeros(engine.info.vocab_size, dtype=bool)
    for i, piece in text_tokens(engine):
        out[i] = any(w.startswith(prefix + piece) for w in whole)
    out[list(stop_ids(engine))] = prefix in whole
    return out


def drawn_allowed(engine, texts: list[str], prefix: bytes) -> np.ndarray:
    """The tokens a generation may draw after `prefix`: where every text that goes on from it starts with
    the same bytes (a forced text), the first token of the tokenizer's own spelling of those bytes,
    encoded on their own; elsewhere every token `prefix_allowed` allows."""
    rest = [t.encode()[len(prefix):] for t in texts if t.encode().startswith(prefix)]
    forced = os.path.commonprefix(rest)
    if not forced or not all(rest):
        return prefix_allowed(engine, texts, prefix)
    out = np.zeros(engine.info.vocab_size, dtype=bool)
    out[engine.tokenizer(forced.decode(), add_special_tokens=False).input_ids[0]] = True
    return out


def digits_allowed(engine, prefix: bytes) -> np.ndarray:
    """[0-9]*: every token whose text keeps the whole text digits; the stop tokens always."""
    out = np.zeros(engine.info.vocab_size, dtype=bool)
    for i, piece in text_tokens(engine):
        out[i] = re.fullmatch(rb"[0-9]*", prefix + piece) is not None
    out[list(stop_ids(engine))] = True
    return out


def tid(name: str) -> int:
    return int(name.split(":")[1])


def logsumexp(values: np.ndarray) -> float:
    return float(np.logaddexp.reduce(values))


def check_choice(engine, reference, prompt_ids, choice, allowed_of, k, drawn_of=None):
    """Every generated position of a `logprobs_mode: both` choice against the reference: the allowed
    mass over `allowed_of(text)`, the processed numbers over `drawn_of(text)` (default: the same set)."""
    raw, processed = choice["logprobs"], choice["processed_logprobs"]
    gen = [tid(t) for t in raw["tokens"]]
    ref = reference.logprobs(prompt_ids + gen).numpy()
    assert len(choice["constraint_logprobs"]) == len(gen)
    text = b""
    for i, token in enumerate(gen):
        row = ref[len(prompt_ids) - 1 + i]
        allowed = allowed_of(text)
        drawn = allowed if drawn_of is None else drawn_of(text)
        assert drawn[token] and not (drawn & ~allowed).any(), (i, token)
        mass = logsumexp(row[allowed])
        renormalised = np.where(drawn, row - logsumexp(row[drawn]), -np.inf)
        assert abs(raw["token_logprobs"][i] - row[token]) < TOL
        assert abs(choice["constraint_logprobs"][i] - mass) < TOL
        assert abs(processed["token_logprobs"][i] - renormalised[token]) < TOL
        # The processed top-k: the k likeliest allowed tokens, renormalised; where fewer are allowed,
        # the rest are tokens of probability 0 (-9999.0, the wire's -inf).
        top = {tid(name): value for name, value in processed["top_logprobs"][i].items()}
        assert len(top) in (k, k + 1) and token in top  # the k likeliest and the token itself
        for t, value in top.items():
            if value == NEG_INF_WIRE:
                assert not drawn[t], (i, t)
            else:
                assert drawn[t] and abs(value - renormalised[t]) < TOL, (i, t)
        order = np.argsort(-renormalised)[:min(k, int(drawn.sum()))]
        kth = renormalised[order[-1]]
        assert {t for t in order.tolist() if renormalised[t] > kth + 1e-6} <= set(top)
        text += engine.table.text_bytes(token)
    return gen


def answer_allowed(engine, answer: str):
    """A decided choice (test_choice_decision.py) spells its answer's tokens: the allowed set is the
    answer's next token, and once it is spelled the stop tokens."""
    ids = engine.tokenizer(answer, add_special_tokens=False).input_ids
    spelled = [b"".join(engine.table.text_bytes(t) for t in ids[:i]) for i in range(len(ids) + 1)]

    def allowed_of(text: bytes) -> np.ndarray:
        at = spelled.index(text)
        out = np.zeros(engine.info.vocab_size, dtype=bool)
        out[[ids[at]] if at < len(ids) else list(stop_ids(engine))] = True
        return out

    return allowed_of


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_choice_list_against_reference(client, reference, tiny_engine, seed):
    prompt = "Answer:"
    prompt_ids = tiny_engine.tokenizer(prompt).input_ids
    out = post(client, prompt=prompt, max_tokens=8, logprobs=5, logprobs_mode="both", seed=seed,
               structured_outputs={"choice": CHOICES}, return_tokens_as_token_ids=True)
    choice = out["choices"][0]
    text = choice["text"]
    assert text in CHOICES and choice["finish_reason"] == "stop"
    check_choice(tiny_engine, reference, prompt_ids, choice, answer_allowed(tiny_engine, text), 5)


@pytest.mark.parametrize("seed", [5, 6])
def test_digits_regex_against_reference(client, reference, tiny_engine, seed):
    prompt_ids = [5, 17, 300, 4242]
    out = post(client, prompt=prompt_ids, max_tokens=5, logprobs=3, logprobs_mode="both", seed=seed,
               structured_outputs={"regex": "[0-9]*"}, return_tokens_as_token_ids=True)
    choice = out["choices"][0]
    assert re.fullmatch("[0-9]*", choice["text"])
    check_choice(tiny_engine, reference, prompt_ids, choice, lambda text: digits_allowed(tiny_engine, text), 3)


def test_greedy_takes_the_likeliest_allowed_token(client, reference, tiny_engine):
    prompt_ids = [5, 17, 300, 4242]
    out = post(client, prompt=prompt_ids, max_tokens=5, temperature=0, logprobs=1,
               structured_outputs={"regex": "[0-9]*"}, return_tokens_as_token_ids=True)
    gen = [tid(t) for t in out["choices"][0]["logprobs"]["tokens"]]
    ref = reference.logprobs(prompt_ids + gen).numpy()
    text = b""
    for i, token in enumerate(gen):
        row = np.where(digits_allowed(tiny_engine, text), ref[len(prompt_ids) - 1 + i], -np.inf)
        assert row[token] >= row.max() - TOL
        text += tiny_engine.table.text_bytes(token)


def test_schema_samples_validate_and_follow_the_processed_numbers(client, reference, tiny_engine):
    """200 seeded samples: each validates; each spells the forced `{"answer":"` the tokenizer's way,
    and the token after it follows the reference renormalised over the tokens allowed there (a bound
    of 4 standard deviations + 0.02: seeded, so the same counts every run, and far from the bound)."""
    prompt = "JSON:"
    prompt_ids = tiny_engine.tokenizer(prompt).input_ids
    forced = tiny_engine.tokenizer('{"answer":"', add_special_tokens=False).input_ids
    texts, next_tokens, seed = [], [], 100
    while len(texts) < 200:
        out = post(client, prompt=prompt, max_tokens=20, n=16, seed=seed, logprobs=0,
                   response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
                   return_tokens_as_token_ids=True)
        for choice in out["choices"]:
            texts.append(choice["text"])
            tokens = [tid(t) for t in choice["logprobs"]["tokens"]]
            assert tokens[:len(forced)] == forced
            next_tokens.append(tokens[len(forced)])
        seed += 1
    texts, next_tokens = texts[:200], next_tokens[:200]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1
    row = reference.logprobs(prompt_ids + forced).numpy()[-1]
    allowed = prefix_allowed(tiny_engine, SCHEMA_TEXTS, b'{"answer":"')
    assert np.array_equal(allowed, drawn_allowed(tiny_engine, SCHEMA_TEXTS, b'{"answer":"'))  # nothing forced
    probs = np.exp(row - logsumexp(row[allowed])) * allowed
    assert set(next_tokens) <= set(np.flatnonzero(allowed).tolist())
    for token in np.flatnonzero(allowed):
        p = probs[token]
        frequency = next_tokens.count(int(token)) / 200
        assert abs(frequency - p) <= 4 * math.sqrt(p * (1 - p) / 200) + 0.02, (token, frequency, p)


def test_schema_choice_numbers_against_reference(client, reference, tiny_engine):
    prompt = "JSON:"
    prompt_ids = tiny_engine.tokenizer(prompt).input_ids
    out = post(client, prompt=prompt, max_tokens=20, seed=9, logprobs=4, logprobs_mode="both",
               structured_outputs={"json": SCHEMA}, return_tokens_as_token_ids=True)
    choice = out["choices"][0]
    assert choice["text"] in SCHEMA_TEXTS
    check_choice(tiny_engine, reference, prompt_ids, choice,
                 lambda text: prefix_allowed(tiny_engine, SCHEMA_TEXTS, text), 4,
                 lambda text: drawn_allowed(tiny_engine, SCHEMA_TEXTS, text))


@pytest.mark.parametrize("context", [None, "Count: "])
def test_score_under_a_constraint(client, reference, tiny_engine, context):
    inputs = ["123", "4"]
    body = dict(path="/v1/score", input=inputs, structured_outputs={"regex": "[0-9]+"})
    if context is not None:
        body["context"] = context
    out = post(client, **body)
    for item, text in zip(out["data"], inputs):
        head = [tiny_engine.info.bos_token_id]
        if context is not None:
            head += tiny_engine.tokenizer(context, add_special_tokens=False).input_ids
        ids = item["token_ids"]
        ref = reference.logprobs(head + ids).numpy()
        block = item["constraint"]
        prefix, total_mass, total = b"", 0.0, 0.0
        for j, token in enumerate(ids):
            row = ref[len(head) - 1 + j]
            allowed = np.zeros(len(row), dtype=bool)
            for i, piece in text_tokens(tiny_engine):
                allowed[i] = re.fullmatch(rb"[0-9]+", prefix + piece) is not None
            if prefix:  # [0-9]+ is complete after a digit: the end may come
                allowed[list(stop_ids(tiny_engine))] = True
            mass = logsumexp(row[allowed])
            assert abs(block["constraint_logprobs"][j] - mass) < TOL
            assert abs(block["token_logprobs"][j] - (row[token] - mass)) < TOL
            assert abs(item["token_logprobs"][j] - row[token]) < TOL  # the raw numbers are unchanged
            total_mass += mass
            total += row[token] - mass
            prefix += tiny_engine.table.text_bytes(token)
        assert abs(block["constraint_logprob"] - total_mass) < 1e-4
        assert abs(block["logprob"] - total) < 1e-4
        assert block["is_complete"] is True
    # The same raw numbers as without the constraint (to float32 rounding: the whole-vocabulary rows
    # are a pass of their own)
    plain = post(client, path="/v1/score", input=inputs, **({"context": context} if context else {}))
    for constrained, unconstrained in zip(out["data"], plain["data"]):
        np.testing.assert_allclose(constrained["token_logprobs"], unconstrained["token_logprobs"], atol=TOL, rtol=0)


def test_score_prefix_is_not_complete(client):
    out = post(client, path="/v1/score", input='{"answer":"ye', structured_outputs={"json": SCHEMA})
    assert out["data"][0]["constraint"]["is_complete"] is False


def test_a_banned_spelling_of_a_forced_text_falls_back_to_the_others(client, reference, tiny_engine):
    """`bad_words` bans the tokenizer's first token of the forced `{"answer":"`: the draw takes the other
    tokens that keep the text inside, and the numbers are those of that set less the banned token."""
    forced = tiny_engine.tokenizer('{"answer":"', add_special_tokens=False).input_ids
    banned = tiny_engine.table.token_bytes[forced[0]].decode()
    prompt_ids = tiny_engine.tokenizer("JSON:").input_ids
    out = post(client, prompt="JSON:", max_tokens=20, seed=3, logprobs=2, logprobs_mode="both",
               structured_outputs={"json": SCHEMA}, bad_words=[banned], return_tokens_as_token_ids=True)
    choice = out["choices"][0]
    assert choice["text"] in SCHEMA_TEXTS
    first = tid(choice["logprobs"]["tokens"][0])
    assert first != forced[0]
    allowed = prefix_allowed(tiny_engine, SCHEMA_TEXTS, b"")
    allowed[forced[0]] = False
    row = reference.logprobs(prompt_ids).numpy()[-1]
    assert allowed[first]
    assert abs(choice["constraint_logprobs"][0] - logsumexp(row[allowed])) < TOL
    assert abs(choice["processed_logprobs"]["token_logprobs"][0] - (row[first] - logsumexp(row[allowed]))) < TOL
