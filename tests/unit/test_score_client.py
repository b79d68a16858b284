"""The one client of /v1/score (client/http.py) as the dataset job uses it: a connection refused before
any server answered ends the job at its first attempt, naming the address; rows count as each request
comes back, not a whole chunk at once."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from logprobe.datasets import job, progress
from logprobe.datasets.columns import ScoreOptions
from logprobe.datasets.io import DatasetError, Row
from logprobe.datasets.scorer import RemoteScorer


class Counting(httpx.AsyncBaseTransport):
    """httpx's own transport, counting the requests sent through it."""

    def __init__(self, inner):
        self.inner, self.sent = inner, 0

    async def handle_async_request(self, request):
        self.sent += 1
        return await self.inner.handle_async_request(request)

    async def aclose(self):
        await self.inner.aclose()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def test_a_refused_connection_ends_the_job_at_its_first_attempt():
    url = f"http://127.0.0.1:{closed_port()}"
    transport = Counting(httpx.AsyncHTTPTransport())
    scorer = RemoteScorer([url], model="tiny", max_attempts=2, transport=transport)
    with pytest.raises(DatasetError) as caught:
        scorer.score([Row(0, "a", "hello")])
    assert transport.sent == 1  # no second attempt, no wait before one
    assert caught.value.message.startswith(f"cannot connect to {url} (")
    assert "gave up" not in caught.value.message


def test_rows_count_as_each_request_comes_back(monkeypatch, tmp_path):
    class Recorder:
        def __init__(self, *args, **kwargs):
            self.updates = []

        def update(self, rows, tokens):
            self.updates.append((rows, tokens))

        def close(self):
            pass

    bars = []
    monkeypatch.setattr(progress, "make", lambda *a, **k: bars.append(Recorder()) or bars[-1])

    def answer(request):
        inputs = json.loads(request.content)["input"]
        return httpx.Response(200, json={"data": [{"num_tokens": 2, "logprob": -1.0, "mean_logprob": -0.5,
                                                   "perplexity": 1.6} for _ in inputs]})

    source = tmp_path / "rows.jsonl"
    source.write_text("".join('{"text": "row %d"}\n' % i for i in range(6)) + '{"text": ""}\n')
    scorer = RemoteScorer(["http://a"], model="tiny", concurrency=1, batch_rows=2,
                          transport=httpx.MockTransport(answer))
    assert job.run(str(source), str(tmp_path / "out.jsonl"), scorer, ScoreOptions(), max_rows=200) == 7
    (bar,) = bars
    assert bar.updates == [(2, 4), (2, 4), (2, 4), (1, 0)]  # one chunk of 7 rows, counted request by request
