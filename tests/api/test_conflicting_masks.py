"""A request whose own fields leave no token to generate (`allowed_token_ids`, `bad_words`, a constraint
and `min_tokens` that disagree), on the engine over HTTP: a 400 naming the fields in the endpoint's
envelope (completions, chat, `n: 2`, a stream whose first token conflicts), an error event naming them
after the chunks already sent when it shows mid-stream, a batch line's error record with 400; never a
server error, never in /health. Requests in the same engine step are checked unharmed in
tests/model/test_steering_reference.py."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from batch_helpers import jsonl, lines_of, request_line, sdk, wait_for
from logprobe.api.app import create_app
from logprobe.batch import runner as batch_runner
from logprobe.config import BatchSettings, Limits

PATHS = ["/v1/completions", "/v1/chat/completions"]
YES, NO = 9805, 787  # " yes" and " no", one token each in SmolLM2's tokenizer
# a regex, not a choice list: a choice is decided whole before generation (api/serving/choice_decision.py), so a
# choice no allowed token spells is refused before anything runs (test_a_choice_nothing_can_spell_...)
FIRST = {"structured_outputs": {"regex": " yes"}, "allowed_token_ids": [330]}  # " A": no token at all
LATER = {"structured_outputs": {"regex": " yes no"}, "allowed_token_ids": [YES]}  # " yes", then nothing
AT_FIRST = "'structured_outputs' and 'allowed_token_ids' together allow no token at generated token 1"
AT_SECOND = "'structured_outputs' and 'allowed_token_ids' together allow no token at generated token 2"


def body_for(path: str, **fields) -> dict:
    body = {"model": "tiny", "max_tokens": 3, "temperature": 0, **fields}
    if path == "/v1/completions":
        return {"prompt": "x", **body}
    return {"messages": [{"role": "user", "content": "x"}], **body}


def health(client) -> tuple:
    """What /health says of the engine's failures."""
    h = client.get("/health").json()
    return h["status"], h["engine_failures"], h.get("last_error")


def refused(r, message: str, param: str = "structured_outputs") -> None:
    assert r.status_code == 400, r.text
    body = r.json()
    assert set(body) == {"error", "request_id"} and body["request_id"] == r.headers["x-request-id"]
    err = body["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_request", param), err
    assert message in err["message"], err["message"]


def sse_events(text: str) -> list:
    blocks = text.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]", text[-300:]
    return [json.loads(b[len("data: "):]) for b in blocks[:-2]]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("stream", [False, True])
def test_a_conflict_at_the_first_token_is_a_400(client, path, n, stream):
    """Nothing was sent yet, streamed or not: the status is the request's 400, and the engine is not
    counted failing."""
    before = health(client)
    refused(client.post(path, json=body_for(path, n=n, stream=stream, **FIRST)), AT_FIRST)
    assert health(client) == before
    assert client.post(path, json=body_for(path, n=n, stream=stream)).status_code == 200  # the engine serves on


@pytest.mark.parametrize("path", PATHS)
def test_a_conflict_at_a_later_token_is_a_400(client, path):
    before = health(client)
    refused(client.post(path, json=body_for(path, n=2, **LATER)), AT_SECOND)
    assert health(client) == before


def test_the_message_names_the_fields_the_body_used(client):
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    refused(client.post("/v1/chat/completions", json=body_for("/v1/chat/completions", response_format=schema,
                                                                 allowed_token_ids=[330])),
            "'response_format' and 'allowed_token_ids' together allow no token at generated token 1",
            "response_format")
    # the regex is complete after " yes": only the end may follow, and min_tokens masks it
    refused(client.post("/v1/completions", json=body_for("/v1/completions", structured_outputs={"regex": " yes"},
                                                         allowed_token_ids=[YES], min_tokens=2)),
            "'structured_outputs', 'allowed_token_ids' and 'min_tokens' together allow no token at generated token 2")
    refused(client.post("/v1/completions", json=body_for("/v1/completions", allowed_token_ids=[YES],
                                                         bad_words=[" yes yes"])),
            "'allowed_token_ids' and 'bad_words' together allow no token at generated token 2", "allowed_token_ids")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("stream", [False, True])
def test_a_choice_nothing_can_spell_is_a_400_before_anything_runs(client, path, stream):
    """A choice list is decided whole; when every answer spells a token the request rules out, the 400
    names the choice and the field that rules it out."""
    before = health(client)
    body = body_for(path, stream=stream, structured_outputs={"choice": [" yes", " yes no"]}, allowed_token_ids=[330])
    refused(client.post(path, json=body), "every choice in 'structured_outputs.choice' spells a token that "
            "'allowed_token_ids' rules out", "structured_outputs.choice")
    assert health(client) == before


@pytest.mark.parametrize("path", PATHS)
def test_a_conflict_mid_stream_is_an_error_event(client, path):
    """The first token went out with its 200: the conflict at the second is the stream's error event (the
    endpoint's envelope, the same message), then [DONE]; no chunk carries a finish_reason."""
    before = health(client)
    r = client.post(path, json=body_for(path, stream=True, logprobs=True if "chat" in path else 1, **LATER))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    *chunks, last = events
    assert chunks and all("choices" in c for c in chunks)
    assert all(choice["finish_reason"] is None for c in chunks for choice in c["choices"])
    texts = [ch.get("text", ch.get("delta", {}).get("content")) or "" for c in chunks for ch in c["choices"]]
    assert "".join(texts) == " yes"
    assert set(last) == {"error", "request_id"} and last["request_id"] == r.headers["x-request-id"]
    err = last["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_request",
                                                        "structured_outputs")
    assert AT_SECOND in err["message"]
    assert health(client) == before


def test_a_batch_line_with_a_conflict_is_a_400_record(tiny_engine, tmp_path):
    """The line's error record carries 400 and the message; the other lines are answered."""
    app = create_app(tiny_engine, Limits())
    batch_runner.install(app, BatchSettings(data_dir=str(tmp_path)))
    lines = [request_line("plain", "/v1/completions", body_for("/v1/completions")),
             request_line("conflict", "/v1/completions", body_for("/v1/completions", **FIRST)),
             request_line("chat", "/v1/chat/completions", body_for("/v1/chat/completions", **LATER))]
    with TestClient(app) as client:
        before = health(client)
        oai = sdk(client)
        uploaded = oai.files.create(file=("lines.jsonl", jsonl(lines[:2])), purpose="batch")
        done = wait_for(oai, oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                                completion_window="24h").id)
        (answered,), (error,) = lines_of(oai, done.output_file_id), lines_of(oai, done.error_file_id)
        assert answered["custom_id"] == "plain" and answered["response"]["status_code"] == 200
        assert error["custom_id"] == "conflict" and error["response"]["status_code"] == 400
        assert AT_FIRST in error["response"]["body"]["error"]["message"]
        uploaded = oai.files.create(file=("chat.jsonl", jsonl(lines[2:])), purpose="batch")
        done = wait_for(oai, oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                completion_window="24h").id)
        (error,) = lines_of(oai, done.error_file_id)
        assert error["response"]["status_code"] == 400 and AT_SECOND in error["response"]["body"]["error"]["message"]
        assert health(client) == before


def test_a_tree_whose_root_allows_nothing_is_a_400(client):
    """/v1/tree under masks that leave no first token has no tree to give: the same 400; a node deeper
    down that allows nothing is a leaf (docs/api.md, /v1/tree)."""
    before = health(client)
    body = {"model": "tiny", "prompt": "x", "depth": 2, "branches": 2, **FIRST}
    refused(client.post("/v1/tree", json=body), AT_FIRST)
    later = client.post("/v1/tree", json={"model": "tiny", "prompt": "x", "depth": 3, "branches": 2, **LATER})
    assert later.status_code == 200, later.text
    nodes = later.json()["nodes"]
    assert [n["token_id"] for n in nodes] == [YES]  # " yes", then nothing: a leaf
    assert health(client) == before
