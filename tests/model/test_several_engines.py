"""Two engines in one server (several --model): each request's numbers are its own model's, checked
against a float64 forward of that model's weights, while both models run at the same time."""

from __future__ import annotations

import concurrent.futures

import pytest
from fastapi.testclient import TestClient

from logprobe.api.app import attach_backends, create_app
from logprobe.config import Limits
from logprobe.engine.engine import Engine

TOL = 1e-5


@pytest.fixture(scope="module")
def two_engines(tiny_model, tiny_model_factory, tokenizer, reference_of):
    other = tiny_model_factory(len(tokenizer), seed=1, num_hidden_layers=3)
    first = Engine(tiny_model, tokenizer, "lab/first", ["first"])
    second = Engine(other, tokenizer, "lab/second", ["second"])
    first.start()
    second.start()
    yield (first, reference_of(tiny_model)), (second, reference_of(other))
    first.stop()
    second.stop()


def test_each_model_answers_with_its_own_numbers(two_engines, tokenizer):
    (first, ref_first), (second, ref_second) = two_engines
    app = create_app(None, Limits())
    attach_backends(app, [first, second])
    prompt = "The quick brown fox"
    ids = tokenizer(prompt).input_ids

    def ask(client, model):
        r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8,
                                                 "temperature": 0, "logprobs": 0, "echo": True,
                                                 "return_tokens_as_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()

    with TestClient(app) as client:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # both engines busy at once
            answers = list(pool.map(lambda m: (m, ask(client, m)), ["first", "second"] * 3))
        cards = client.get("/v1/models").json()["data"]
    assert [c["num_layers"] for c in cards] == [2, 3]
    for model, out in answers:
        ref = (ref_first if model == "first" else ref_second)
        lp = out["choices"][0]["logprobs"]
        all_ids = [int(t.split(":")[1]) for t in lp["tokens"]]
        assert all_ids[:len(ids)] == ids
        rows = ref.logprobs(all_ids).numpy()
        for i in range(1, len(all_ids)):
            assert abs(lp["token_logprobs"][i] - rows[i - 1][all_ids[i]]) < TOL, (model, i)
        gen = all_ids[len(ids):]
        assert all(rows[len(ids) - 1 + j].argmax() == t or
                   rows[len(ids) - 1 + j].max() - rows[len(ids) - 1 + j][t] < TOL for j, t in enumerate(gen))
    # the two models disagree (they are different weights): the check above would catch a mix-up
    by_model = {m: o["choices"][0]["logprobs"]["token_logprobs"][1:len(ids)] for m, o in answers}
    assert by_model["first"] != by_model["second"]
