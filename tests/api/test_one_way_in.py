"""Every request that runs a model enters through one pipeline (api/serving/pipeline.py): a check added to it
refuses the same body over HTTP, as a batch line, as a dataset job's row and in `logprobe score TEXT`;
and the one vocabulary check names the vocabulary's size (vLLM's message)."""

from __future__ import annotations

import argparse
import asyncio

import orjson
import pytest
from fastapi.testclient import TestClient

from logprobe.api.serving import pipeline
from logprobe.api.app import create_app
from logprobe.api.errors import InvalidRequest
from logprobe.api.score import serving as scoring
from logprobe.api.serving.holding import Call, admit
from logprobe.backend import BATCH, INTERACTIVE, GenerationRequest, SamplingParams
from logprobe.batch import runner as batch_runner
from logprobe.batch.store import Line
from logprobe.config import BatchSettings, Limits
from logprobe.datasets.io import Row
from logprobe.datasets.scorer import InProcessScorer
from logprobe import score_cli

MESSAGE = "Invalid value for 'input': this server scores no text with the word 'forbidden'."


def no_forbidden_word(endpoint, target, req, prepared, limits) -> None:
    if any(isinstance(text, str) and "forbidden" in text for text in getattr(req, "inputs", ())):
        raise InvalidRequest(MESSAGE, "input")


@pytest.fixture
def with_check(monkeypatch):
    monkeypatch.setattr(pipeline, "CHECKS", [no_forbidden_word])


def test_a_check_added_to_the_pipeline_refuses_on_every_way_in(with_check, fake_backend, tmp_path):
    body = {"model": "tiny", "input": "a forbidden text"}
    app = create_app(fake_backend, Limits())
    # HTTP
    with TestClient(app) as client:
        r = client.post("/v1/score", json=body)
        assert r.status_code == 400 and r.json()["error"]["message"] == MESSAGE
        assert r.json()["error"]["param"] == "input"
        assert client.post("/v1/score", json={**body, "input": "a fine text"}).status_code == 200
    # a batch line, as the batch runner answers it
    batch_runner.install(app, BatchSettings(data_dir=str(tmp_path)))
    runner = batch_runner.BatchRunner(app, app.state.batch_store, 86400)
    asyncio.run(runner._run_line(Line("batch_1", 0, "line-0", orjson.dumps(body), "anonymous", "/v1/score")))
    (result,) = runner.results
    line = orjson.loads(result.data)
    assert result.is_error and line["response"]["status_code"] == 400
    assert line["response"]["body"]["error"]["message"] == MESSAGE
    # a dataset job's row, in process
    scorer = InProcessScorer(fake_backend)
    refused, fine = scorer.prepare([Row(0, "a", "a forbidden text"), Row(1, "b", "a fine text")])
    assert refused.error == MESSAGE and fine.error is None and fine.item is not None
    # logprobe score TEXT, in process
    with pytest.raises(SystemExit, match=f"logprobe score: {MESSAGE}"):
        score_cli.answer_in_process(fake_backend, argparse.Namespace(text=body["input"], context=None, no_bos=False,
                                                                     top=0))


@pytest.mark.parametrize("fields", [
    {"input": "a text", "add_bos": True, "position_stats": False},
    {"input": "a text", "context": "before it", "add_bos": False, "top_logprobs": 3, "position_stats": True,
     "logprob_token_ids": [[5, 9]]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "add_bos": True,
     "position_stats": False},
])
def test_a_typed_request_is_the_parsed_body(fields):
    """An in-process caller's typed request (a dataset's row, `logprobe score TEXT`) is what /v1/score
    makes of the same fields sent as a body."""
    assert scoring.request("tiny", **fields) == scoring.parse({"model": "tiny", **fields}, Limits())


def test_a_typed_request_holds_each_argument_in_its_field():
    """Each keyword lands in its own field, written out here rather than read back from the parser: a text
    after its context, what to compute, the asked ids per position; a conversation, its last assistant
    turn scored."""
    req = scoring.request("tiny", input="a text", context="before it", add_bos=False, top_logprobs=3,
                          position_stats=True, logprob_token_ids=[[5, 9]])
    assert (req.model, req.inputs, req.contexts, req.add_bos, req.top_logprobs, req.position_stats) == \
        ("tiny", ["a text"], ["before it"], False, 3, True)
    assert req.logprob_token_ids == [[(5, 9)]] and req.messages is None
    chat = scoring.request("tiny", messages=[{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}])
    assert chat.inputs == [] and chat.scored_turns == [1] and chat.add_bos and chat.top_logprobs is None


@pytest.mark.parametrize("fields, param", [
    ({"input": "a text", "top_logprobs": 101}, "top_logprobs"),
    ({"input": []}, "input"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ({"input": "a text", "logprob_token_ids": [["x"]]}, "logprob_token_ids"),
    ({"input": "a text", "context": ["one", "two"]}, "context"),
])
def test_a_typed_request_is_refused_as_its_body(fields, param):
    """A value /v1/score refuses in a body is refused in a typed request, with the same message and param."""
    with pytest.raises(InvalidRequest) as body:
        scoring.parse({"model": "tiny", **fields}, Limits())
    with pytest.raises(InvalidRequest) as typed:
        scoring.request("tiny", **fields)
    assert body.value.param == typed.value.param == param
    assert typed.value.message == body.value.message


@pytest.mark.parametrize("path, field, body", [
    ("/v1/completions", "logit_bias", {"prompt": "x", "max_tokens": 1, "logit_bias": {"49152": 1}}),
    ("/v1/completions", "allowed_token_ids", {"prompt": "x", "max_tokens": 1, "allowed_token_ids": [1, 49152]}),
    ("/v1/completions", "prompt", {"prompt": [1, 49152], "max_tokens": 1}),
    ("/v1/score", "input", {"input": [1, 49152]}),
    ("/detokenize", "tokens", {"tokens": [1, 49152]}),
])
def test_an_id_outside_the_vocabulary_names_its_size(fake_client, path, field, body):
    """vLLM's own test reads the vocabulary's size (49152 here) in the message, with the field."""
    r = fake_client.post(path, json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field
    assert error["message"] == (f"Invalid value for '{field}': token id 49152 is outside the vocabulary of "
                                "49152 tokens (ids 0 to 49151).")


def test_the_engine_requests_carry_the_callers_priority(fake_backend, tmp_path, monkeypatch):
    """The pipeline builds the engine's requests with the caller's priority: a batch line's are "batch",
    a choice list's scoring requests too (they run before the line's own, under a hold of their own), and
    an HTTP request's "interactive". Taking the hold (`admit`) leaves them as they were built."""
    seen = []
    real = fake_backend.stream

    def recording(requests, k):
        seen.append([r.priority for r in requests])
        return real(requests, k)

    monkeypatch.setattr(fake_backend, "stream", recording)
    body = {"model": "tiny", "prompt": "Pick:", "max_tokens": 2, "structured_outputs": {"choice": [" a", " b", " c"]}}
    app = create_app(fake_backend, Limits())
    with TestClient(app) as client:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
    assert seen == [["interactive"] * 3, ["interactive"]]  # the three answers scored, then the request
    seen.clear()
    batch_runner.install(app, BatchSettings(data_dir=str(tmp_path)))
    runner = batch_runner.BatchRunner(app, app.state.batch_store, 86400)
    asyncio.run(runner._run_line(Line("batch_1", 0, "line-0", orjson.dumps(body), "anonymous", "/v1/completions")))
    (result,) = runner.results
    assert not result.is_error and orjson.loads(result.data)["response"]["status_code"] == 200
    assert seen == [["batch"] * 3, ["batch"]]
    # the hold waits in the queue of the call's priority, and leaves the requests as they were built
    requests = [GenerationRequest("req_1", [256, 104], SamplingParams(max_tokens=1))]
    hold = asyncio.run(admit(app.state.admission, Call("req_1", priority=BATCH), requests))
    assert hold.priority == BATCH and requests[0].priority == INTERACTIVE
    app.state.admission.release(hold, used=0)
