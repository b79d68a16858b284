"""`structured_outputs.choice` decided by each answer's own log probability (api/serving/choice_decision.py),
against the float64 forward of the same weights: every answer's `choice_logprobs` entry is the
reference's sum over its tokens (the answer encoded on its own, after the prompt's tokens); greedy
spells the likeliest answer, its emitted tokens' raw numbers are the reference's; seeded samples follow
softmax(logprob / temperature) over the answers; completions, chat, `n`, streaming; the prompt runs
through the blocks once for all the answers; the refusals."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from test_prefix_cache_requests import counting

TOL = 1e-5
MODEL = "tiny"
# " no" and " yes" share their first byte, "maybe so" is two tokens, "no" has no space
CHOICES = [" yes", " no", "maybe so", "no"]


def post(client, path="/v1/completions", status=200, **body):
    body.setdefault("model", MODEL)
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    return r.json()


def answer_ids(engine, text: str) -> list[int]:
    return engine.tokenizer(text, add_special_tokens=False).input_ids


def reference_answers(engine, reference, prompt_ids: list[int], choices=CHOICES) -> np.ndarray:
    """Each answer's log probability after the prompt, from the float64 forward."""
    out = []
    for text in choices:
        ids = answer_ids(engine, text)
        ref = reference.logprobs(prompt_ids + ids).numpy()
        out.append(sum(ref[len(prompt_ids) - 1 + i][t] for i, t in enumerate(ids)))
    return np.array(out)


def check_block(engine, block, expected, choices=CHOICES):
    assert [entry["text"] for entry in block] == choices
    assert [entry["num_tokens"] for entry in block] == [len(answer_ids(engine, c)) for c in choices]
    np.testing.assert_allclose([entry["logprob"] for entry in block], expected, atol=1e-4, rtol=0)


def tid(name: str) -> int:
    return int(name.split(":")[1])


@pytest.mark.parametrize("prompt", ["Answer:", "Is the sky blue? Answer:"])
def test_greedy_spells_the_likeliest_answer(client, reference, tiny_engine, prompt):
    prompt_ids = tiny_engine.tokenizer(prompt).input_ids
    expected = reference_answers(tiny_engine, reference, prompt_ids)
    out = post(client, prompt=prompt, max_tokens=8, temperature=0, logprobs=2, logprobs_mode="both",
               structured_outputs={"choice": CHOICES}, return_tokens_as_token_ids=True)
    choice = out["choices"][0]
    check_block(tiny_engine, choice["choice_logprobs"], expected)
    best = int(np.argmax(expected))
    assert choice["text"] == CHOICES[best] and choice["finish_reason"] == "stop"
    # the emitted tokens: the answer's own, then a stop token; their raw numbers are the reference's
    tokens = [tid(t) for t in choice["logprobs"]["tokens"]]
    assert tokens[:-1] == answer_ids(tiny_engine, CHOICES[best])
    assert tokens[-1] in {tiny_engine.info.eos_token_id} | set(tiny_engine.info.stop_token_ids)
    ref = reference.logprobs(prompt_ids + tokens).numpy()
    for i, token in enumerate(tokens):
        row = ref[len(prompt_ids) - 1 + i]
        assert abs(choice["logprobs"]["token_logprobs"][i] - row[token]) < TOL
        top = sorted(choice["logprobs"]["top_logprobs"][i].values(), reverse=True)[:2]
        np.testing.assert_allclose(top, np.sort(row)[::-1][:2], atol=TOL)
    # each step allowed the answer's next token (then the stop tokens): that is the mass kept
    stops = sorted({tiny_engine.info.eos_token_id} | set(tiny_engine.info.stop_token_ids))
    masses = [ref[len(prompt_ids) - 1 + i][t] for i, t in enumerate(tokens[:-1])]
    masses.append(float(np.logaddexp.reduce(ref[len(prompt_ids) - 1 + len(tokens) - 1][stops])))
    np.testing.assert_allclose(choice["constraint_logprobs"], masses, atol=TOL)
    assert choice["processed_logprobs"]["token_logprobs"] == [0.0] * len(tokens)


def test_samples_follow_the_answers_distribution(client, reference, tiny_engine):
    """200 seeded samples at temperature 2 (the answers' probabilities spread out): each answer's
    frequency within 4 standard deviations + 0.02 of softmax(logprob / 2); the same seed draws the same
    answers again."""
    prompt = "Answer:"
    prompt_ids = tiny_engine.tokenizer(prompt).input_ids
    probs = np.exp(reference_answers(tiny_engine, reference, prompt_ids) / 2.0)
    probs /= probs.sum()
    texts = []
    for seed in range(10, 30):
        out = post(client, prompt=prompt, max_tokens=4, n=10, seed=seed, temperature=2.0,
                   structured_outputs={"choice": CHOICES})
        texts += [c["text"] for c in out["choices"]]
    for text, p in zip(CHOICES, probs):
        frequency = texts.count(text) / len(texts)
        assert abs(frequency - p) <= 4 * math.sqrt(p * (1 - p) / len(texts)) + 0.02, (text, frequency, p)
    again = post(client, prompt=prompt, max_tokens=4, n=10, seed=10, temperature=2.0,
                 structured_outputs={"choice": CHOICES})
    assert [c["text"] for c in again["choices"]] == texts[:10]


def test_top_k_and_top_p_filter_the_answers(client, reference, tiny_engine):
    prompt_ids = tiny_engine.tokenizer("Answer:").input_ids
    best = CHOICES[int(np.argmax(reference_answers(tiny_engine, reference, prompt_ids)))]
    for extra in ({"top_k": 1}, {"top_p": 1e-9}):
        out = post(client, prompt="Answer:", max_tokens=4, n=8, seed=1, temperature=2.0,
                   structured_outputs={"choice": CHOICES}, **extra)
        assert {c["text"] for c in out["choices"]} == {best}, extra


def test_several_prompts_stream_and_chat(client, reference, tiny_engine):
    prompts = ["Answer:", "The colour of grass:"]
    out = post(client, prompt=prompts, max_tokens=4, temperature=0, n=2, structured_outputs={"choice": CHOICES})
    streamed = client.post("/v1/completions", json={"model": MODEL, "prompt": prompts, "max_tokens": 4,
                                                    "temperature": 0, "n": 2, "stream": True,
                                                    "structured_outputs": {"choice": CHOICES}})
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    for g, prompt in enumerate(prompts):
        expected = reference_answers(tiny_engine, reference, tiny_engine.tokenizer(prompt).input_ids)
        for j in range(2):
            choice = out["choices"][g * 2 + j]
            check_block(tiny_engine, choice["choice_logprobs"], expected)
            assert choice["text"] == CHOICES[int(np.argmax(expected))]
            mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == g * 2 + j]
            assert "".join(c["text"] for c in mine) == choice["text"]
            assert mine[0]["choice_logprobs"] == choice["choice_logprobs"]
            assert all("choice_logprobs" not in c for c in mine[1:])
    messages = [{"role": "user", "content": "Is the sky blue?"}]
    chat = post(client, "/v1/chat/completions", messages=messages, max_tokens=4, temperature=0, logprobs=True,
                structured_outputs={"choice": CHOICES})
    ids = tiny_engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tiny_engine.tokenizer(ids, add_special_tokens=False).input_ids
    expected = reference_answers(tiny_engine, reference, ids)
    choice = chat["choices"][0]
    check_block(tiny_engine, choice["choice_logprobs"], expected)
    assert choice["message"]["content"] == CHOICES[int(np.argmax(expected))]


def test_the_prompt_runs_once_for_every_answer(client, tiny_engine, monkeypatch):
    """A 40-token prompt and four answers: the tokens run through the blocks are the prompt once, the
    answers (one pass, right-padded to the longest), and the generation's: the prompt past its whole
    blocks, found in the prefix cache, and one token a step after the first."""
    passes = counting(tiny_engine, monkeypatch)
    prompt = " ".join(["counting"] * 39)
    prompt_ids = tiny_engine.tokenizer(prompt).input_ids
    assert len(prompt_ids) == 40
    out = post(client, prompt=prompt, max_tokens=4, temperature=0, structured_outputs={"choice": CHOICES})
    answers = len(CHOICES) * max(len(answer_ids(tiny_engine, c)) for c in CHOICES)
    generated = out["usage"]["completion_tokens"]
    assert sum(passes) <= len(prompt_ids) + answers + len(prompt_ids) % 16 + generated - 1, passes
    assert max(passes) <= len(prompt_ids)


@pytest.mark.parametrize("body, param, words", [
    ({"logit_bias": {"330": 5}}, "logit_bias", ["logit_bias", "structured_outputs.choice"]),
    ({"interventions": [{"layer": 1, "op": "zero"}]}, "interventions", ["interventions", "structured_outputs.choice"]),
    ({"allowed_token_ids": [330]}, "structured_outputs.choice", ["allowed_token_ids", "structured_outputs.choice"]),
    ({"bad_words": [" yes", " no", "maybe", "no"]}, "structured_outputs.choice",
     ["bad_words", "structured_outputs.choice"]),
])
def test_refusals(client, body, param, words):
    out = post(client, status=400, prompt="x", max_tokens=3, structured_outputs={"choice": CHOICES}, **body)
    assert out["error"]["param"] == param
    assert all(w in out["error"]["message"] for w in words)


def test_an_answer_past_the_context_is_refused(client, tiny_engine):
    ctx = tiny_engine.info.context_length
    out = post(client, status=400, prompt=[5] * (ctx - 4), max_tokens=2,
               structured_outputs={"choice": ["a", " yes" * 8]})
    assert out["error"]["param"] == "structured_outputs.choice" and "choice at index 1" in out["error"]["message"]


def test_allowed_and_bad_words_leave_answers_out(client, reference, tiny_engine):
    """An answer whose tokens are not all allowed, or that spells a bad word, is never drawn; its log
    probability is still reported."""
    prompt_ids = tiny_engine.tokenizer("Answer:").input_ids
    expected = reference_answers(tiny_engine, reference, prompt_ids)
    order = [CHOICES[i] for i in np.argsort(-expected)]
    out = post(client, prompt="Answer:", max_tokens=4, temperature=0, structured_outputs={"choice": CHOICES},
               bad_words=[order[0]])
    assert out["choices"][0]["text"] == order[1]
    check_block(tiny_engine, out["choices"][0]["choice_logprobs"], expected)
    allowed = answer_ids(tiny_engine, order[2]) + [tiny_engine.info.eos_token_id]
    out = post(client, prompt="Answer:", max_tokens=4, temperature=0, structured_outputs={"choice": CHOICES},
               allowed_token_ids=allowed)
    assert out["choices"][0]["text"] == order[2]


def test_max_tokens_cuts_the_answer_short(client, reference, tiny_engine):
    """The answer is decided whole; `max_tokens` then cuts what is spelled ("length")."""
    prompt_ids = tiny_engine.tokenizer("Answer:").input_ids
    choices = ["maybe so", "perhaps not at all"]
    expected = reference_answers(tiny_engine, reference, prompt_ids, choices)
    out = post(client, prompt="Answer:", max_tokens=1, temperature=0, logprobs=0, echo=True,
               structured_outputs={"choice": choices}, return_tokens_as_token_ids=True)
    choice = out["choices"][0]
    best = choices[int(np.argmax(expected))]
    assert choice["finish_reason"] == "length"
    assert choice["text"] == "Answer:" + tiny_engine.tokenizer.decode(answer_ids(tiny_engine, best)[:1])
    assert [tid(t) for t in choice["logprobs"]["tokens"]] == prompt_ids + answer_ids(tiny_engine, best)[:1]
    check_block(tiny_engine, choice["choice_logprobs"], expected, choices)


def test_a_choice_list_is_capped_as_score_inputs_are(client):
    """Each answer is scored after each prompt, as /v1/score scores its inputs: at most max_prompts (256)
    scored texts in one request, a 400 naming the cap before any work."""
    many = [f" {i}" for i in range(257)]
    out = post(client, status=400, prompt="Pick a number:", max_tokens=2, structured_outputs={"choice": many})
    assert out["error"]["param"] == "structured_outputs.choice"
    assert "max_prompts" in out["error"]["message"] and "257 answers" in out["error"]["message"]
    out = post(client, status=400, prompt=["a", "b"], max_tokens=2, structured_outputs={"choice": many[:129]})
    assert "129 answers x 2 prompts = 258" in out["error"]["message"]
    out = post(client, status=400, path="/v1/chat/completions", messages=[{"role": "user", "content": "Pick."}],
               max_tokens=2, structured_outputs={"choice": many})
    assert out["error"]["param"] == "structured_outputs.choice"
    assert post(client, prompt="Pick a number:", max_tokens=2, temperature=0,
                structured_outputs={"choice": many[:256]})["choices"][0]["text"] in many


def test_usage_counts_the_scoring_of_the_answers(client, tiny_engine, caplog):
    """The answers' scoring passes are charged as /v1/score charges its inputs (each answer with the
    prompt in full) and usage reports them in prompt_tokens: the response, the streamed usage, chat, and
    the access log (which the key's budget is charged from) agree."""
    import logging

    prompt = "Is the sky blue? Answer:"
    prompt_ids = tiny_engine.tokenizer(prompt).input_ids
    scored = sum(len(prompt_ids) + len(answer_ids(tiny_engine, c)) for c in CHOICES)
    with caplog.at_level(logging.INFO, logger="logprobe.access"):
        out = post(client, prompt=prompt, max_tokens=4, temperature=0, structured_outputs={"choice": CHOICES})
    usage = out["usage"]
    assert usage["prompt_tokens"] == len(prompt_ids) + scored
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > usage["prompt_tokens"]
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "logprobe.access"]
    assert [(x["prompt_tokens"], x["completion_tokens"]) for x in lines if x["path"] == "/v1/completions"] == [
        (usage["prompt_tokens"], usage["completion_tokens"])]
    streamed = client.post("/v1/completions", json={"model": MODEL, "prompt": [prompt, prompt], "max_tokens": 4,
                                                    "temperature": 0, "stream": True,
                                                    "stream_options": {"include_usage": True},
                                                    "structured_outputs": {"choice": CHOICES}})
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["prompt_tokens"] == 2 * (len(prompt_ids) + scored)
    messages = [{"role": "user", "content": "Is the sky blue?"}]
    rendered = client.post("/tokenize", json={"messages": messages}).json()["count"]
    chat = post(client, "/v1/chat/completions", messages=messages, max_tokens=4, temperature=0,
                structured_outputs={"choice": CHOICES})
    assert chat["usage"]["prompt_tokens"] == rendered + sum(rendered + len(answer_ids(tiny_engine, c))
                                                            for c in CHOICES)
    plain = post(client, prompt=prompt, max_tokens=4, temperature=0)
    assert plain["usage"]["prompt_tokens"] == len(prompt_ids)  # without a choice list: the prompt alone


def test_the_answers_reach_the_engine_as_score_inputs_do(client, tiny_engine, monkeypatch):
    """A large choice list shares the engine as /v1/score does: its answers are handed to the engine as
    prompt-only requests of the same number, length and priority as the same answers sent to /v1/score
    (inputs after the prompt as context), so the scheduler serves a request sent beside it as it would
    beside that /v1/score, and no differently (the cap above bounds both alike)."""
    runs = []
    real = tiny_engine.stream

    def recording(requests, k):  # the engine's one path: a request answered whole drains it (k None)
        runs.append([(len(r.prompt_ids), r.params.max_tokens, r.params.n, r.priority) for r in requests])
        return real(requests, k)

    monkeypatch.setattr(tiny_engine, "stream", recording)
    answers = [f" {i}" for i in range(200)]
    prompt = "Pick a number:"
    post(client, prompt=prompt, max_tokens=3, temperature=0, structured_outputs={"choice": answers})
    scoring = runs[0]
    runs.clear()
    post(client, "/v1/score", input=answers, context=prompt, add_bos=False)
    (score,) = runs
    assert len(scoring) == len(score) == 200
    assert all(m == 0 and n == 1 for _, m, n, _ in scoring + score)
    assert {p for *_, p in scoring} == {p for *_, p in score}
    prompt_len = len(tiny_engine.tokenizer(prompt).input_ids)
    assert sorted(t for t, *_ in scoring) == sorted(prompt_len + len(answer_ids(tiny_engine, a)) for a in answers)
    # /v1/score tokenizes the context and each input apart, as the choice list does its prompt and answers
    assert sorted(t for t, *_ in scoring) == sorted(t for t, *_ in score)
