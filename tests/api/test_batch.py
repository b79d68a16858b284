"""The Batch API over HTTP on the fake backend, driven by the openai SDK: the objects' shapes, every
refusal, a bad line as an error-file entry, two keys that cannot see each other, cancel mid-run,
expiry and retention on an injected clock, /metrics."""

from __future__ import annotations

import time
from collections import Counter

import openai
import pytest
from fastapi.testclient import TestClient

from batch_helpers import Gate, jsonl, lines_of, request_line, sdk, settle, until, wait_for
from fake_backend import FakeBackend
from logprobe.api.app import create_app
from logprobe.batch import runner as batch_runner
from logprobe.config import BatchSettings, Limits

KEYS = ("key-alpha", "key-beta")


class Clock:
    def __init__(self):
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def build(tokenizer, tmp_path, *, gate=None, clock=None, keys=KEYS, in_flight=128, **settings):
    backend = FakeBackend(tokenizer, name="test/tiny-llama", aliases=("tiny",), num_layers=2, d_model=64,
                          context_length=256)
    backend.gate = gate
    app = create_app(backend, Limits(), api_keys=keys)
    batch_runner.install(app, BatchSettings(data_dir=str(tmp_path), **settings), clock or time.time)
    store = app.state.batch_store
    app.state.make_batch_runner = lambda: batch_runner.BatchRunner(app, store, 30 * 86400, in_flight=in_flight)
    return app


@pytest.fixture
def app(tokenizer, tmp_path):
    return build(tokenizer, tmp_path)


def score_lines(n: int, model="tiny") -> list[dict]:
    return [request_line(f"line-{i}", "/v1/score", {"model": model, "input": "word " * (1 + i % 7)})
            for i in range(n)]


def upload(oai, lines: list[dict]):
    return oai.files.create(file=("lines.jsonl", jsonl(lines)), purpose="batch")


def test_round_trip_shapes_and_a_bad_line(app):
    lines = score_lines(6) + [request_line("bad", "/v1/score", {"model": "tiny", "input": 3})]
    with TestClient(app) as client:
        oai = sdk(client, KEYS[0])
        uploaded = upload(oai, lines)
        assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines)) and uploaded.status == "processed"
        assert oai.files.retrieve(uploaded.id).filename == "lines.jsonl"
        assert oai.files.content(uploaded.id).content == jsonl(lines)
        batch = oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/score", completion_window="24h",
                                   metadata={"run": "one"})
        assert batch.status == "validating" and batch.metadata == {"run": "one"}
        assert batch.request_counts.total == 7 and batch.output_file_id is None
        done = wait_for(oai, batch.id)
        assert done.status == "completed" and done.model == "test/tiny-llama"
        assert (done.request_counts.completed, done.request_counts.failed) == (6, 1)
        assert done.in_progress_at and done.finalizing_at and done.completed_at
        output, errors = lines_of(oai, done.output_file_id), lines_of(oai, done.error_file_id)
        assert sorted(x["custom_id"] for x in output) == sorted(x["custom_id"] for x in lines[:6])
        for entry in output:
            assert set(entry) == {"id", "custom_id", "response", "error"} and entry["error"] is None
            assert entry["id"].startswith("batch_req_") and entry["response"]["status_code"] == 200
            sent = next(x["body"] for x in lines if x["custom_id"] == entry["custom_id"])
            alone = client.post("/v1/score", json=sent, headers={"authorization": f"Bearer {KEYS[0]}"}).json()
            assert entry["response"]["body"] == alone  # the same numbers as the body sent alone
        bad, = errors
        alone = client.post("/v1/score", json=lines[6]["body"], headers={"authorization": f"Bearer {KEYS[0]}"})
        assert bad["custom_id"] == "bad" and bad["response"]["status_code"] == alone.status_code == 400
        got, want = bad["response"]["body"], alone.json()
        assert got["error"] == want["error"] and got["request_id"] == bad["response"]["request_id"]
        listed = oai.batches.list(limit=5)
        assert [b.id for b in listed.data] == [batch.id] and not listed.has_more
        assert oai.files.delete(uploaded.id).deleted
        with pytest.raises(openai.NotFoundError):
            oai.files.retrieve(uploaded.id)
        assert oai.batches.retrieve(batch.id).status == "completed"  # a batch keeps its lines


def test_list_pages_with_after_and_limit(app):
    with TestClient(app) as client:
        oai = sdk(client, KEYS[0])
        file_id = upload(oai, score_lines(1)).id
        ids = [oai.batches.create(input_file_id=file_id, endpoint="/v1/score", completion_window="24h").id
               for _ in range(5)]
        first = oai.batches.list(limit=2)
        assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
        rest = oai.batches.list(limit=10, after=first.data[-1].id)
        assert [b.id for b in rest.data] == ids[::-1][2:] and not rest.has_more
        assert [b.id for b in oai.batches.list(limit=2)] == ids[::-1]  # the SDK follows the pages
        for batch_id in ids:
            wait_for(oai, batch_id)
        bad = client.get("/v1/batches?limit=0", headers={"authorization": f"Bearer {KEYS[0]}"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"


def refusal(call) -> dict:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    return {"status": caught.value.status_code, **caught.value.body}


def test_every_refusal_names_its_param(tokenizer, tmp_path):
    app = build(tokenizer, tmp_path, max_file_bytes=4000, max_batch_lines=5)
    with TestClient(app) as client:
        oai = sdk(client, KEYS[0])

        def create(file_id, endpoint="/v1/score", window="24h", **extra):
            return lambda: oai.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window=window,
                                              **extra)

        cases = [
            (lambda: oai.files.create(file=("x.jsonl", b"{not json}\n"), purpose="batch"), 400, "file", "not JSONL"),
            (lambda: oai.files.create(file=("x.jsonl", b"[1, 2]\n"), purpose="batch"), 400, "file", "not a JSON object"),
            (lambda: oai.files.create(file=("x.jsonl", jsonl(score_lines(2) + score_lines(1))), purpose="batch"),
             400, "file", "repeats the custom_id"),
            (lambda: oai.files.create(file=("x.jsonl", jsonl([{**score_lines(1)[0], "method": "GET"}])),
                                      purpose="batch"), 400, "file", "method"),
            (lambda: oai.files.create(file=("x.jsonl", jsonl([request_line("a", "/v1/embeddings", {})])),
                                      purpose="batch"), 400, "file", "'url'"),
            (lambda: oai.files.create(file=("x.jsonl", b"\n\n"), purpose="batch"), 400, "file", "no request lines"),
            (lambda: oai.files.create(file=("x.jsonl", b"x" * 5000), purpose="batch"), 400, "file", "max_file_bytes"),
            (lambda: oai.files.create(file=("x.jsonl", jsonl(score_lines(1))), purpose="fine-tune"), 400, "purpose",
             "purpose"),
        ]
        good = upload(oai, score_lines(3)).id
        many = upload(oai, score_lines(6)).id
        other_endpoint = upload(oai, score_lines(1) + [request_line("c", "/v1/completions",
                                                                     {"model": "tiny", "prompt": "x"})]).id
        unknown_model = upload(oai, score_lines(1, model="no-such-model")).id
        cases += [
            (create(many), 400, "input_file_id", "max_batch_lines"),
            (create(other_endpoint), 400, "input_file_id", "one endpoint"),
            (create(unknown_model), 400, "input_file_id", "does not serve"),
            (create("file-missing"), 404, "input_file_id", "No such file"),
            (create(good, endpoint="/v1/embeddings"), 400, "endpoint", "endpoint"),
            (create(good, window="1h"), 400, "completion_window", "completion_window"),
            (create(good, metadata={"k": 1}), 400, "metadata", "metadata"),
            (create(good, metadata={f"k{i}": "v" for i in range(17)}), 400, "metadata", "16"),
            (lambda: oai.batches.retrieve("batch_missing"), 404, None, "No such batch"),
            (lambda: oai.batches.cancel("batch_missing"), 404, None, "No such batch"),
            (lambda: oai.files.content("file-missing"), 404, None, "No such file"),
        ]
        for call, status, param, words in cases:
            got = refusal(call)
            assert got["status"] == status and got["param"] == param and words in got["message"], got
        done = wait_for(oai, oai.batches.create(input_file_id=good, endpoint="/v1/score", completion_window="24h").id)
        got = refusal(lambda: oai.batches.cancel(done.id))
        assert got["status"] == 409 and "completed" in got["message"]
        over = client.post("/v1/files", content=b"x" * 70_000, headers={
            "authorization": f"Bearer {KEYS[0]}", "content-type": "multipart/form-data; boundary=b"})
        assert over.status_code == 400 and over.json()["error"]["param"] == "file"


def test_a_streamed_line_is_refused_per_line(app):
    lines = [request_line("s", "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "stream": True}),
             request_line("p", "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 2})]
    with TestClient(app) as client:
        oai = sdk(client, KEYS[0])
        batch = oai.batches.create(input_file_id=upload(oai, lines).id, endpoint="/v1/completions",
                                   completion_window="24h")
        done = wait_for(oai, batch.id)
        error, = lines_of(oai, done.error_file_id)
        assert error["custom_id"] == "s" and error["response"]["body"]["error"]["param"] == "stream"
        assert [x["custom_id"] for x in lines_of(oai, done.output_file_id)] == ["p"]


def test_two_keys_cannot_see_each_other(app):
    with TestClient(app) as client:
        alpha, beta = sdk(client, KEYS[0]), sdk(client, KEYS[1])
        file_a = upload(alpha, score_lines(3))
        batch_a = wait_for(alpha, alpha.batches.create(input_file_id=file_a.id, endpoint="/v1/score",
                                                       completion_window="24h").id)
        missing = refusal(lambda: beta.files.retrieve("file-missing"))
        for call in (lambda: beta.files.retrieve(file_a.id), lambda: beta.files.content(file_a.id),
                     lambda: beta.files.content(batch_a.output_file_id), lambda: beta.files.delete(file_a.id),
                     lambda: beta.batches.retrieve(batch_a.id), lambda: beta.batches.cancel(batch_a.id),
                     lambda: beta.batches.create(input_file_id=file_a.id, endpoint="/v1/score",
                                                 completion_window="24h")):
            got = refusal(call)
            assert got["status"] == 404 and got["code"] == missing["code"] == "not_found"
        assert beta.files.list().data == [] and beta.batches.list().data == []
        assert {f.id for f in alpha.files.list().data} == {file_a.id, batch_a.output_file_id}
        text = client.get("/metrics").text
        assert "key-" not in text and batch_a.id not in text and file_a.id not in text
        assert 'logprobe_batches{status="completed"} 1.0' in text
        assert 'logprobe_batch_lines{result="done"} 3.0' in text
        no_key = client.get("/v1/batches")
        assert no_key.status_code == 401


def test_cancel_mid_run(tokenizer, tmp_path):
    """Two lines answered, the next two held in the backend when the batch is cancelled: those two stop
    (not errors), no other line runs, and nothing is written after `cancelled`."""
    gate = Gate(passes=2)
    app = build(tokenizer, tmp_path, gate=gate, in_flight=2)
    lines = [request_line(f"c{i}", "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 8,
                                                       "temperature": 0}) for i in range(40)]
    with TestClient(app) as client:
        oai = sdk(client, KEYS[0])
        batch = oai.batches.create(input_file_id=upload(oai, lines).id, endpoint="/v1/completions",
                                   completion_window="24h")
        until(lambda: oai.batches.retrieve(batch.id).request_counts.completed == 2 and gate.num_held == 2,
              "two lines answered and two held")
        cancelling = oai.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
        done = wait_for(oai, batch.id)
        assert done.status == "cancelled" and done.cancelled_at
        assert gate.num_held == 0  # the held lines were stopped, not left waiting
        output = lines_of(oai, done.output_file_id)
        assert len(output) == done.request_counts.completed == 2
        assert done.error_file_id is None and done.request_counts.failed == 0  # stopped lines are not errors
        assert max(Counter(x["custom_id"] for x in output).values()) == 1
        gate.open()  # nothing more is run or written after `cancelled`, even with the backend free to run
        settle(client, app.state.batch_runner)
        assert gate.num_entered == 4  # no line of the cancelled batch was run again
    oai = sdk(TestClient(app), KEYS[0])  # the runner stopped, every answer it made committed; no new runner
    after = oai.batches.retrieve(batch.id)
    assert after.status == "cancelled" and after.request_counts.completed == 2
    assert lines_of(oai, after.output_file_id) == output


def test_expiry_and_retention_on_an_injected_clock(tokenizer, tmp_path):
    """One line answered and one held in the backend when the window ends: the held one stops, it and
    the 28 never started go to the error file as expired; 30 days later everything is deleted."""
    clock, gate = Clock(), Gate(passes=1)
    app = build(tokenizer, tmp_path, gate=gate, clock=clock, in_flight=1, file_retention_days=30,
                batch_retention_days=30)
    lines = [request_line(f"e{i}", "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 6})
             for i in range(30)]
    with TestClient(app) as client:
        oai = sdk(client, KEYS[0])
        runner = app.state.batch_runner
        uploaded = upload(oai, lines)
        batch = oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        assert batch.expires_at == batch.created_at + 24 * 3600
        until(lambda: oai.batches.retrieve(batch.id).request_counts.completed == 1 and gate.num_held == 1,
              "one line answered and one held")
        clock.now += 24 * 3600 + 1
        runner._swept = 0.0  # the expiry sweep runs in the next round
        client.portal.call(runner.wake)
        done = wait_for(oai, batch.id)
        assert done.status == "expired" and done.expired_at and gate.num_held == 0
        output, errors = lines_of(oai, done.output_file_id), lines_of(oai, done.error_file_id)
        assert done.request_counts.completed == len(output) == 1
        assert done.request_counts.failed == len(errors) == 29
        assert Counter(x["custom_id"] for x in output + errors) == Counter(x["custom_id"] for x in lines)
        for entry in errors:
            assert entry["response"] is None and entry["error"]["code"] == "batch_expired"
        gate.open()  # nothing more is run or written after `expired`
        settle(client, runner)
        assert gate.num_entered == 2
        after = oai.batches.retrieve(batch.id)
        assert (after.status, after.request_counts.completed, after.request_counts.failed) == ("expired", 1, 29)
        clock.now += 30 * 86400
        runner._swept = 0.0
        client.portal.call(runner.wake)
        until(lambda: not oai.files.list().data and not any((tmp_path / "files").iterdir()),
              "the files past their retention to be deleted")
        assert oai.files.list().data == [] and oai.batches.list().data == []
        assert refusal(lambda: oai.files.content(uploaded.id))["status"] == 404
        assert not any((tmp_path / "files").iterdir())


def test_a_rate_limited_line_waits_instead_of_failing(tokenizer, tmp_path, monkeypatch):
    """A 429 from the hold (a key's budget) is never an answer of a batch line: the line runs again."""
    from logprobe.api.serving import admission as admission_module

    app = build(tokenizer, tmp_path)
    real = admission_module.Admission.acquire
    calls = {"n": 0}

    async def flaky(self, key, tokens, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] <= 3:
            raise admission_module.RateLimited("Rate limit reached for your key.", 0.01)
        return await real(self, key, tokens, *args, **kwargs)

    monkeypatch.setattr(admission_module.Admission, "acquire", flaky)
    with TestClient(app) as client:
        oai = sdk(client, KEYS[0])
        done = wait_for(oai, oai.batches.create(input_file_id=upload(oai, score_lines(2)).id, endpoint="/v1/score",
                                                completion_window="24h").id)
        assert done.request_counts.completed == 2 and done.request_counts.failed == 0 and calls["n"] >= 5


def test_a_batch_whose_model_is_gone_fails(tokenizer, tmp_path):
    """A batch created, then the server restarted on the same --data-dir serving another model: failed,
    with the reason in `errors`."""
    before = build(tokenizer, tmp_path)
    client = TestClient(before)  # outside `with`: no lifespan, so no runner takes the batch
    oai = sdk(client, KEYS[0])
    batch = oai.batches.create(input_file_id=upload(oai, score_lines(2)).id, endpoint="/v1/score",
                               completion_window="24h")
    after = build(tokenizer, tmp_path)
    after.state.backend.info.name, after.state.backend.info.aliases = "test/another", ["another"]
    with TestClient(after) as restarted:
        done = wait_for(sdk(restarted, KEYS[0]), batch.id)
    assert done.status == "failed" and done.failed_at and done.errors.data[0].code == "model_not_found"
    assert done.output_file_id is None and done.request_counts.completed == 0
