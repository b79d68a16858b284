"""POST /v1/responses on the fake backend, driven by the openai SDK (its typed objects must parse): text
and message input against /v1/chat/completions on the same conversation (the same prompt tokens, text,
log probabilities and usage), OpenAI's streamed event sequence, and every refusal by name."""

from __future__ import annotations

import openai
import orjson
import pytest
from openai.types.responses import Response, ResponseTextDeltaEvent

from batch_helpers import sdk
from logprobe.backend import BackendUnavailable

MODEL = "tiny"
LOGPROBS = ["message.output_text.logprobs"]
EVENTS = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def oai(fake_client):
    return sdk(fake_client)


def chat_twin(fake_client, messages, max_tokens, top_logprobs):
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "logprobs": True,
            "top_logprobs": top_logprobs}
    answer = fake_client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def last_prompt(fake_backend) -> list[int]:
    return list(fake_backend.calls[-1].requests[0].prompt_ids)


def entries_of(response: Response) -> list[dict]:
    (message,) = response.output
    (part,) = message.content
    return [entry.model_dump() for entry in part.logprobs]


def test_text_input_equals_the_chat_completion(oai, fake_client, fake_backend):
    response = oai.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=6, temperature=0,
                                    include=LOGPROBS, top_logprobs=3)
    prompt = last_prompt(fake_backend)
    chat = chat_twin(fake_client, [{"role": "user", "content": "Name a colour."}], 6, 3)
    assert last_prompt(fake_backend) == prompt
    assert isinstance(response, Response) and response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat["choices"][0]["message"]["content"]
    assert entries_of(response) == chat["choices"][0]["logprobs"]["content"]
    assert all(len(e["top_logprobs"]) == 3 for e in entries_of(response))
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (
        chat["usage"]["prompt_tokens"], chat["usage"]["completion_tokens"], chat["usage"]["total_tokens"])
    assert response.usage.input_tokens_details.cached_tokens == 0
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    # cut by max_output_tokens: incomplete, as OpenAI's
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.output[0].role == "assistant"
    assert (response.max_output_tokens, response.top_logprobs, response.temperature) == (6, 3, 0)
    assert response.model == "test/tiny-llama" and response.tools == [] and response.text.format.type == "text"


def test_message_input_with_instructions_and_parts(oai, fake_client, fake_backend):
    items = [{"role": "developer", "content": "Answer briefly."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                                             {"type": "input_text", "text": " there."}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]},
             {"role": "user", "content": "Again?"}]
    response = oai.responses.create(model=MODEL, input=items, instructions="You are terse.", max_output_tokens=4,
                                    temperature=0, include=LOGPROBS)
    prompt = last_prompt(fake_backend)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Again?"}]
    chat = chat_twin(fake_client, messages, 4, 0)
    assert last_prompt(fake_backend) == prompt
    assert response.instructions == "You are terse."
    assert response.output_text == chat["choices"][0]["message"]["content"]
    assert entries_of(response) == chat["choices"][0]["logprobs"]["content"]
    assert all(e["top_logprobs"] == [] for e in entries_of(response))


def test_without_include_no_logprobs_are_computed(oai, fake_backend):
    response = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=3, temperature=0)
    assert fake_backend.calls[-1].requests[0].params.logprobs is None
    assert response.output[0].content[0].logprobs == [] and response.top_logprobs == 0
    assert response.usage.output_tokens == 3


def test_the_stream_is_openais_event_sequence(oai, fake_client):
    kw = dict(model=MODEL, input=[{"role": "user", "content": "Count."}], max_output_tokens=7, temperature=0,
              include=LOGPROBS, top_logprobs=2)
    plain = oai.responses.create(**kw)
    events = list(oai.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    num_deltas = len(kinds) - len(EVENTS) - len(CLOSING) - 1
    assert kinds == EVENTS + ["response.output_text.delta"] * num_deltas + CLOSING + ["response.incomplete"]
    assert num_deltas >= 1 and all(isinstance(e, ResponseTextDeltaEvent) for e in events[4:4 + num_deltas])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, deltas, final = events[0], events[4:4 + num_deltas], events[-1]
    assert created.response.status == "in_progress" and created.response.output == []
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 and e.content_index == 0 for e in deltas)
    text = "".join(e.delta for e in deltas)
    assert text == plain.output_text == events[len(EVENTS) + num_deltas].text
    # each delta's entries are the shape of OpenAI's delta event: token, logprob, top_logprobs (no bytes)
    streamed = [entry.model_dump() for e in deltas for entry in e.logprobs]
    short = [{"token": e["token"], "logprob": e["logprob"],
              "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
             for e in entries_of(plain)]
    assert streamed == short
    assert [x.model_dump() for x in events[len(EVENTS) + num_deltas].logprobs] == short
    assert final.response.status == "incomplete" and final.response.output[0].id == item_id
    assert entries_of(final.response) == entries_of(plain)  # the whole entries, bytes included
    assert final.response.usage.model_dump() == plain.usage.model_dump()
    assert final.response.id == created.response.id != plain.id


def test_the_stream_is_framed_as_named_events_without_done(fake_client):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "stream": True}
    with fake_client.stream("POST", "/v1/responses", json=body) as answer:
        raw = b"".join(answer.iter_bytes())
    assert answer.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in raw.split(b"\n\n") if b]
    assert b"[DONE]" not in raw and len(blocks) == 4 + 2 + 4
    for block in blocks:
        event, data = block.split(b"\n")
        assert event.startswith(b"event: ") and data.startswith(b"data: ")
        assert orjson.loads(data[6:])["type"] == event[7:].decode()
    assert orjson.loads(blocks[4].split(b"\n")[1][6:])["logprobs"] == []  # not asked: an empty list


def test_a_failure_mid_stream_is_an_error_event(fake_client, fake_backend, monkeypatch):
    monkeypatch.setattr(fake_backend, "fail_with", BackendUnavailable("the replica went away"))
    monkeypatch.setattr(fake_backend, "fail_after_steps", 2)
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 8, "stream": True}
    with fake_client.stream("POST", "/v1/responses", json=body) as answer:
        raw = b"".join(answer.iter_bytes())
    blocks = [orjson.loads(b.split(b"\n")[1][6:]) for b in raw.split(b"\n\n") if b]
    error = blocks[-1]
    assert error["type"] == "error" and error["code"] == "unavailable" and "went away" in error["message"]
    assert [b["sequence_number"] for b in blocks] == list(range(len(blocks)))
    assert b"[DONE]" not in raw and not any(b["type"].startswith("response.complete") for b in blocks)


def test_store_is_accepted_and_nothing_is_stored(oai):
    response = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=1, store=True, tool_choice="auto",
                                    tools=[], parallel_tool_calls=False, metadata={}, truncation="disabled")
    assert response.model_extra["store"] is False and response.parallel_tool_calls is False


def test_the_sdk_raises_a_refusal(oai):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.responses.create(model=MODEL, input="Hi", tools=[{"type": "function", "name": "f", "parameters": {}}])
    assert caught.value.body["param"] == "tools"


SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}}
REFUSED = [
    ({"tools": [{"type": "function", "name": "f"}]}, "tools", "Unsupported request argument supplied: tools"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "does not store responses"),
    ({"background": True}, "background", "Unsupported request argument supplied: background"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "'reasoning.encrypted_content' is not available"),
    ({"include": ["file_search_call.results"]}, "include", "takes only 'message.output_text.logprobs'"),
    ({"include": "message.output_text.logprobs"}, "include", "Invalid type for 'include'"),
    ({"conversation": "conv_1"}, "conversation", "Unrecognized request argument supplied: conversation"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "Unsupported request argument supplied: reasoning"),
    ({"top_logprobs": 21, "include": LOGPROBS}, "top_logprobs", "less than or equal to 20"),
    ({"top_logprobs": 2}, "top_logprobs", "only with 'include'"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"max_output_tokens": 400}, "max_output_tokens", "maximum context length is 256 tokens"),
    ({"temperature": 3}, "temperature", "less than or equal to 2"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options", "only allowed with 'stream': true"),
    ({"stream": True, "stream_options": {"include_obfuscation": 1}}, "stream_options.include_obfuscation",
     "Invalid type"),
    ({"stream": True, "stream_options": {"x": 1}}, "stream_options.x", "Unrecognized request argument"),
    ({"text": {"format": {"type": "json_schema", "schema": SCHEMA}}}, "text.format.name", "'text.format.name'"),
    ({"text": {"format": {"type": "json_schema", "name": "a", "strict": "yes"}}}, "text.format.strict",
     "Invalid type for 'text.format.strict'"),
    ({"text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "bogus"}}}}, "text.format.schema",
     "does not compile"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type", "expected 'text', 'json_object'"),
    ({"text": {"format": {"type": "text", "name": "a"}}}, "text.format.name", "only used with 'type': 'json_schema'"),
    ({"text": {"verbosity": "high"}}, "text.verbosity", "Unsupported request argument supplied: verbosity"),
    ({"text": {"format": {"type": "text"}, "color": 1}}, "text.color", "Unrecognized request argument"),
    ({"input": []}, "input", "non-empty array"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input",
     "'input[0].type': logprobe takes message items only"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input",
     "'input[0].content[0].type': only text parts"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "'input[0].role'"),
    ({"input": [{"role": "user", "content": "x", "name": "n"}]}, "input", "input[0].name"),
]


@pytest.mark.parametrize("extra,param,message", REFUSED, ids=[r[1] + str(i) for i, r in enumerate(REFUSED)])
def test_refusals_name_the_field(fake_client, fake_backend, extra, param, message):
    calls = len(fake_backend.calls)
    answer = fake_client.post("/v1/responses", json={"model": MODEL, "input": "Hi", **extra})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert len(fake_backend.calls) == calls  # refused before any work


def test_missing_input_and_unknown_model(fake_client):
    answer = fake_client.post("/v1/responses", json={"model": MODEL})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "input"
    answer = fake_client.post("/v1/responses", json={"model": "nope", "input": "x"})
    assert answer.status_code == 404
