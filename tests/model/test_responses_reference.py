"""/v1/responses on the engine, through the openai SDK, against the float64 forward of the same weights:
every output token's log probability and its top_logprobs are the reference's at the templated
conversation's positions, and equal /v1/chat/completions' on the same conversation; under a JSON schema
(`text.format`) the streamed reply completes, validates, and its numbers are those of the reply
without streaming and of chat's `response_format`; a seeded draw is chat's seeded draw."""

from __future__ import annotations

import json

import pytest

from batch_helpers import sdk

TOL = 1e-5
MODEL = "tiny"
LOGPROBS = ["message.output_text.logprobs"]
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}}, "required": ["answer"],
          "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}


@pytest.fixture(scope="module")
def oai(client):
    return sdk(client)


def chat(client, messages, **body):
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "logprobs": True, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def entries_of(response) -> list[dict]:
    (message,) = response.output
    (part,) = message.content
    return [entry.model_dump() for entry in part.logprobs]


def assert_same_entries(ours: list[dict], theirs: list[dict]) -> None:
    """The same tokens, bytes and top tokens; the numbers within TOL (a request that finds another's
    prompt in the prefix cache sums in another order: the last float32 bit may differ)."""
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert (a["token"], a["bytes"]) == (b["token"], b["bytes"]) and abs(a["logprob"] - b["logprob"]) < TOL
        named = [[(t["token"], t["bytes"]) for t in entry["top_logprobs"]] for entry in (a, b)]
        assert named[0] == named[1]
        assert all(abs(x["logprob"] - y["logprob"]) < TOL for x, y in zip(a["top_logprobs"], b["top_logprobs"]))


def prompt_ids_of(engine, messages) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return engine.tokenizer(text, add_special_tokens=False).input_ids


def check_against_reference(engine, reference, messages, entries, with_ids, k):
    """`entries` (the response's) against the reference at the positions of the tokens `with_ids` (the
    same reply from chat with `return_tokens_as_token_ids`) names."""
    prompt = prompt_ids_of(engine, messages)
    generated = [int(e["token"].split(":")[1]) for e in with_ids["logprobs"]["content"]]
    assert len(generated) == len(entries) > 0
    ref = reference.logprobs(prompt + generated).numpy()
    for i, (entry, token) in enumerate(zip(entries, generated)):
        row = ref[len(prompt) - 1 + i]
        assert entry["bytes"] == list(engine.table.token_bytes[token])
        assert abs(entry["logprob"] - row[token]) < TOL, (i, entry["logprob"], row[token])
        tops = with_ids["logprobs"]["content"][i]["top_logprobs"]
        assert len(entry["top_logprobs"]) == len(tops) == k
        for named, top in zip(entry["top_logprobs"], tops):
            top_id = int(top["token"].split(":")[1])
            assert named["bytes"] == list(engine.table.token_bytes[top_id])
            assert abs(named["logprob"] - row[top_id]) < TOL
        # the k listed are the k likeliest (up to float32 ties at the k-th)
        kth = min(t["logprob"] for t in tops)
        assert (row > kth + 2 * TOL).sum() < k
    return generated


def test_greedy_reply_against_reference_and_chat(oai, client, tiny_engine, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}]
    response = oai.responses.create(model=MODEL, instructions="Be brief.", input="Name a fruit.", temperature=0,
                                    max_output_tokens=8, include=LOGPROBS, top_logprobs=5)
    plain = chat(client, messages, temperature=0, max_tokens=8, top_logprobs=5)
    with_ids = chat(client, messages, temperature=0, max_tokens=8, top_logprobs=5, return_tokens_as_token_ids=True)
    assert response.output_text == plain["message"]["content"]
    assert_same_entries(entries_of(response), plain["logprobs"]["content"])
    generated = check_against_reference(tiny_engine, reference, messages, entries_of(response), with_ids, 5)
    ref = reference.logprobs(prompt_ids_of(tiny_engine, messages) + generated).numpy()
    for i, token in enumerate(generated):  # greedy: each token is the likeliest (up to ties)
        row = ref[len(ref) - len(generated) - 1 + i]
        assert row[token] > row.max() - 2 * TOL
    assert response.usage.input_tokens == len(prompt_ids_of(tiny_engine, messages))
    assert response.usage.output_tokens == 8 and response.status == "incomplete"


def test_schema_reply_streamed_completes_with_the_same_numbers(oai, client, tiny_engine, reference):
    text = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}}
    kw = dict(model=MODEL, input="Yes or no?", temperature=0, max_output_tokens=20, include=LOGPROBS, top_logprobs=3,
              text=text)
    plain = oai.responses.create(**kw)
    # responses.stream() takes top_logprobs by name from openai 1.103; the test floor is 1.97.1
    streamed_kw = {key: value for key, value in kw.items() if key != "top_logprobs"}
    with oai.responses.stream(**streamed_kw, extra_body={"top_logprobs": 3}) as stream:
        deltas = [event for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == plain.status == "completed" and final.incomplete_details is None
    json.loads(final.output_text)  # valid JSON, in the schema's texts
    assert final.output_text in ['{"answer":"%s"}' % v for v in SCHEMA["properties"]["answer"]["enum"]]
    assert final.output_text == plain.output_text == "".join(d.delta for d in deltas)
    assert_same_entries(entries_of(final), entries_of(plain))
    streamed = [e.model_dump() for d in deltas for e in d.logprobs]
    assert [e["token"] for e in streamed] == [e["token"] for e in entries_of(final)]
    assert [e["logprob"] for e in streamed] == [e["logprob"] for e in entries_of(final)]
    messages = [{"role": "user", "content": "Yes or no?"}]
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    same = dict(temperature=0, max_tokens=20, top_logprobs=3, response_format=response_format)
    assert_same_entries(entries_of(plain), chat(client, messages, **same)["logprobs"]["content"])
    with_ids = chat(client, messages, **same, return_tokens_as_token_ids=True)
    check_against_reference(tiny_engine, reference, messages, entries_of(plain), with_ids, 3)
    assert final.usage.output_tokens == plain.usage.output_tokens == len(entries_of(plain)) + 1  # + end of turn


def test_a_seeded_draw_is_chats(oai, client):
    response = oai.responses.create(model=MODEL, input=[{"role": "user", "content": "Tell me a word."}],
                                    temperature=0.9, top_p=0.95, max_output_tokens=6, include=LOGPROBS,
                                    extra_body={"top_k": 50, "seed": 7})  # logprobe's extensions
    plain = chat(client, [{"role": "user", "content": "Tell me a word."}], temperature=0.9, top_p=0.95, seed=7,
                 top_k=50, max_tokens=6)
    assert response.output_text == plain["message"]["content"]
    assert_same_entries(entries_of(response), plain["logprobs"]["content"])
