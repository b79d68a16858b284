"""`logprobe score --input` on a tiny random model: a mixed dataset scored in process and through a
server equals the float64 reference and itself; resume, bad input, retries and the Python API.

Slow: datasets of hundreds of rows, each row against float64."""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import threading

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

from dataset_rows import mixed_rows, write_all  # noqa: E402
from logprobe.datasets import job  # noqa: E402
from logprobe.datasets.columns import ScoreOptions  # noqa: E402
from logprobe.datasets.io import DatasetError, Row, read_rows  # noqa: E402
from logprobe.datasets.scorer import InProcessScorer, RemoteScorer  # noqa: E402

TOL = 1e-5
FULL = ScoreOptions(top=3, tokens=True, stats=True)
READ = job.ReadOptions("text", "context", "id")


@pytest.fixture(scope="module")
def rows():
    return mixed_rows(300, long_words=150)


@pytest.fixture(scope="module")
def files(rows, tmp_path_factory):
    return write_all(rows, tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def in_process(files, tiny_engine, tmp_path_factory):
    """The JSON-lines file scored in process with every option: {id: record}."""
    out = str(tmp_path_factory.mktemp("out") / "scores.parquet")
    count = job.run(files["jsonl"], out, InProcessScorer(tiny_engine, FULL), FULL, READ, progress="none",
                    max_rows=40)
    assert count == 300 and not os.path.exists(out + ".parts")
    return {r["id"]: r for r in pq.read_table(out).to_pylist()}


@pytest.fixture(scope="module")
def tiny_server(tiny_engine):
    """A real HTTP server (uvicorn in a thread) around the tiny engine."""
    import uvicorn

    from logprobe.api.app import create_app
    from logprobe.config import Limits

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(tiny_engine, Limits()), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the tiny server did not start")
        threading.Event().wait(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join()


def test_formats_read_alike(files, rows):
    want = [(i, r["id"], r["text"], r["context"]) for i, r in enumerate(rows)]
    for path in files.values():
        assert [(r.index, r.id, r.text, r.context) for r in read_rows(path, "text", "context", "id")] == want


def test_in_process_equals_float64_reference(in_process, rows, tiny_engine, reference):
    tok, bos = tiny_engine.tokenizer, tiny_engine.info.bos_token_id
    assert list(in_process) == [r["id"] for r in rows]  # input order
    for row in rows:
        got = in_process[row["id"]]
        ids = tok(row["text"], add_special_tokens=False).input_ids
        assert got["token_ids"] == ids and got["num_tokens"] == len(ids)
        if not ids:
            assert got["logprob"] == 0.0 and got["mean_logprob"] is None and got["perplexity"] is None
            assert got["tokens"] == [] and got["entropy"] == []
            continue
        head = [bos] + (tok(row["context"], add_special_tokens=False).input_ids if row["context"] else [])
        ref = reference.logprobs(head + ids)[len(head) - 1:-1]  # row j predicts ids[j]
        want = ref[range(len(ids)), ids].numpy()
        np.testing.assert_allclose(got["token_logprobs"], want, atol=TOL, err_msg=row["id"])
        assert abs(got["logprob"] - want.sum()) < TOL * len(ids)
        assert abs(got["mean_logprob"] - want.mean()) < TOL
        assert math.isclose(got["perplexity"], math.exp(-want.mean()), rel_tol=1e-4)
        entropy = -(ref.exp() * ref).sum(-1).numpy()
        np.testing.assert_allclose(got["entropy"], entropy, atol=1e-4, err_msg=row["id"])
        top = np.sort(ref.numpy(), axis=-1)[:, ::-1][:, :3]
        np.testing.assert_allclose(got["top_logprobs"], top, atol=TOL, err_msg=row["id"])
        for j, (rank, token) in enumerate(zip(got["ranks"], ids)):
            low, high = reference.rank_bounds(ref[j], token)
            assert low <= rank <= high
        assert got["tokens"] == [tiny_engine.table.strings[t] for t in ids]
        assert got["top_tokens"] == [[tiny_engine.table.strings[t] for t in row_ids] for row_ids in got["top_ids"]]


def test_server_equals_in_process(in_process, files, tiny_server, tmp_path):
    options = ScoreOptions(top=3, tokens=True, stats=True)  # entropy from /v1/score's position_stats
    out = str(tmp_path / "remote.jsonl")
    scorer = RemoteScorer([tiny_server, tiny_server + "/"], model="tiny", concurrency=4, options=options,
                          batch_rows=7)
    assert job.run(files["csv"], out, scorer, options, READ, progress="none", max_rows=50) == 300
    with open(out, encoding="utf-8") as fh:
        remote = [json.loads(line) for line in fh]
    assert [r["id"] for r in remote] == list(in_process)
    ranks_equal = ranks_total = 0
    for got in remote:
        want = in_process[got["id"]]
        for name in ("num_tokens", "tokens", "token_ids"):
            assert got[name] == want[name], (got["id"], name)
        # Other batches round differently: a token as likely as others to within float32 may change places
        for a, b in zip(got["ranks"], want["ranks"]):
            assert abs(a - b) <= 2 + b // 1000, (got["id"], a, b)
        ranks_equal += sum(a == b for a, b in zip(got["ranks"], want["ranks"]))
        ranks_total += len(want["ranks"])
        for name in ("logprob", "mean_logprob", "perplexity"):
            assert (got[name] is None) == (want[name] is None)
            if want[name] is not None:
                assert math.isclose(got[name], want[name], rel_tol=TOL, abs_tol=TOL * max(1, got["num_tokens"]))
        if got["num_tokens"]:
            np.testing.assert_allclose(got["token_logprobs"], want["token_logprobs"], atol=TOL)
            np.testing.assert_allclose(got["top_logprobs"], want["top_logprobs"], atol=TOL)
            assert (got["entropy"][0] is None) == (want["entropy"][0] is None)
            np.testing.assert_allclose(np.array(got["entropy"], dtype=float), np.array(want["entropy"], dtype=float),
                                       atol=1e-4, err_msg=got["id"])
            for j, (a, b) in enumerate(zip(got["top_ids"], want["top_ids"])):
                values = want["top_logprobs"][j]
                if len(set(np.round(values, 5))) == len(values):  # no tie: the same ids in the same order
                    assert a == b, (got["id"], j)
                else:
                    assert len(a) == len(b)
            assert got["top_tokens"] is not None
    assert ranks_equal >= 0.98 * ranks_total


def test_output_formats_hold_the_same(files, tiny_model, tokenizer, tmp_path):
    """Each format is a run of its own on one engine, the second and third finding the rows' blocks in
    its prefix cache: every number is the same bits (on torch older than 2.13, whose attention kernel
    gives a cached prefix's queries other bits, the engine keeps no prefix)."""
    from logprobe.engine.engine import Engine
    from logprobe.engine.runners.lean.attention import Attention

    engine = Engine(tiny_model, tokenizer, "test/tiny-llama", ["tiny"],
                    **({} if Attention.invariant_kernels() else {"prefix_cache_mb": 0}))
    engine.start()
    options = ScoreOptions(tokens=True)
    scorer = InProcessScorer(engine, options)
    tables = {}
    try:
        for ext in ("parquet", "jsonl", "csv"):
            out = str(tmp_path / f"out.{ext}")
            job.run(files["parquet"], out, scorer, options, READ, progress="none")
            tables[ext] = out
    finally:
        engine.stop()
    want = pq.read_table(tables["parquet"]).to_pylist()
    with open(tables["jsonl"], encoding="utf-8") as fh:
        got_rows = [json.loads(line) for line in fh]
    assert [sorted(r) for r in got_rows] == [sorted(r) for r in want]
    for got, w in zip(got_rows, want):
        for name in ("id", "num_tokens", "tokens", "token_ids", "ranks", "token_logprobs"):
            assert got[name] == w[name], (w["id"], name)
        for name in ("logprob", "mean_logprob", "perplexity"):
            assert (got[name] is None) == (w[name] is None)
            assert w[name] is None or math.isclose(got[name], w[name], rel_tol=1e-6, abs_tol=1e-4)
    import pyarrow.csv as pacsv

    csv_rows = pacsv.read_csv(tables["csv"], parse_options=pacsv.ParseOptions(newlines_in_values=True),
                              convert_options=pacsv.ConvertOptions(column_types={"id": pa.string()})).to_pylist()
    for got, w in zip(csv_rows, want):
        assert got["id"] == w["id"] and got["num_tokens"] == w["num_tokens"]
        assert json.loads(got["tokens"]) == w["tokens"]
        np.testing.assert_allclose(json.loads(got["token_logprobs"]), w["token_logprobs"], atol=1e-5)
        assert math.isclose(got["logprob"], w["logprob"], rel_tol=1e-6, abs_tol=1e-4)


def test_a_text_past_the_context(tiny_engine, tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "' + "word " * 400 + '"}\n{"text": "also fine"}\n')
    out = str(tmp_path / "out.parquet")
    with pytest.raises(DatasetError, match=r"row 1 \(id '1'\) cannot be scored: .*context length.*--skip-invalid") as info:
        job.run(str(path), out, InProcessScorer(tiny_engine), ScoreOptions(), progress="none")
    # scoring has no max_tokens: the message names what to shorten
    assert "this input is 402 tokens long (with its context and the BOS in front" in str(info.value) and "shorten the input or its context" in str(info.value)
    assert "max_tokens" not in str(info.value)
    assert not os.path.exists(out) and not os.path.exists(out + ".parts")
    options = ScoreOptions(skip_invalid=True)
    job.run(str(path), out, InProcessScorer(tiny_engine, options), options, progress="none")
    table = pq.read_table(out).to_pylist()
    assert [r["error"] is None for r in table] == [True, False, True]
    assert "context length" in table[1]["error"] and table[1]["logprob"] is None and table[0]["num_tokens"] > 0


class Crash(Exception):
    pass


class CrashAfter:
    """A scorer that dies after `chunks` chunks, as a killed job would (parts so far stay)."""

    def __init__(self, inner, chunks: int):
        self.inner, self.left = inner, chunks
        self.model_name = inner.model_name

    def prepare(self, rows):
        return self.inner.prepare(rows)

    def refuse_invalid(self, prepared):
        self.inner.refuse_invalid(prepared)

    async def run(self, prepared):
        if self.left <= 0:
            raise Crash()
        self.left -= 1
        return await self.inner.run(prepared)


def test_resume_scores_every_row_once(in_process, files, tiny_engine, tmp_path):
    options = ScoreOptions(top=3, tokens=True, stats=True)
    out = str(tmp_path / "out.parquet")
    parts = out + ".parts"
    seen_parts = 0
    for chunks in (0, 2, 3):
        with pytest.raises(Crash):
            job.run(files["parquet"], out, CrashAfter(InProcessScorer(tiny_engine, options), chunks), options, READ,
                    progress="none", max_rows=30)
        names = [n for n in os.listdir(parts) if n.startswith("part-")]
        assert len(names) >= seen_parts + chunks - 1 and not os.path.exists(out)
        seen_parts = len(names)
    open(os.path.join(parts, ".tmp-half-written.parquet"), "wb").write(b"PAR1 broken")
    with pytest.raises(DatasetError, match="other input or with other options"):
        job.run(files["parquet"], out, InProcessScorer(tiny_engine, ScoreOptions()), ScoreOptions(), READ,
                progress="none")
    assert job.run(files["parquet"], out, InProcessScorer(tiny_engine, options), options, READ, progress="none",
                   max_rows=30) == 300
    assert not os.path.exists(parts)
    got = pq.read_table(out).to_pylist()
    assert [r["id"] for r in got] == list(in_process)
    for r in got:
        want = in_process[r["id"]]
        assert r["token_ids"] == want["token_ids"] and r["top_ids"] == want["top_ids"]
        assert r["logprob"] == pytest.approx(want["logprob"], abs=TOL * max(1, r["num_tokens"]))
        np.testing.assert_allclose(np.array(r["token_logprobs"], dtype=float),
                                   np.array(want["token_logprobs"], dtype=float), atol=TOL)


def test_a_job_killed_before_its_manifest_starts_over(files, tiny_engine, tmp_path):
    """SIGKILL between making `<output>.parts/` and writing its manifest leaves an empty directory: the
    next run starts over there instead of refusing it as another job's."""
    out = str(tmp_path / "out.parquet")
    os.makedirs(out + ".parts")
    assert job.run(files["parquet"], out, InProcessScorer(tiny_engine, ScoreOptions()), ScoreOptions(), READ,
                   progress="none") == 300
    assert not os.path.exists(out + ".parts") and pq.read_table(out).num_rows == 300


def test_python_api_equals_the_job(in_process, rows, tiny_engine):
    import pandas as pd

    from logprobe.datasets import score

    frame = pd.DataFrame(rows[:40])
    table = score(frame, context="context", ids="id", engine=tiny_engine, tokens=True, progress=False)
    assert table.column("id").to_pylist() == [r["id"] for r in rows[:40]]
    for got in table.to_pylist():
        want = in_process[got["id"]]
        assert got["token_ids"] == want["token_ids"]
        assert got["logprob"] == pytest.approx(want["logprob"], abs=TOL * max(1, got["num_tokens"]))
    plain = score([r["text"] for r in rows[:5]], engine=tiny_engine, progress=False).to_pandas()
    assert list(plain["id"]) == ["0", "1", "2", "3", "4"] and len(plain.columns) == 5
    no_bos = score(["hello world"], engine=tiny_engine, tokens=True, stats=True, add_bos=False, progress=False)
    record = no_bos.to_pylist()[0]
    assert record["num_tokens"] == len(record["token_ids"]) - 1 == 1  # nothing predicts the first token
    assert record["token_logprobs"][0] is None and record["entropy"][0] is None and record["ranks"][0] is None
    assert record["logprob"] == pytest.approx(record["token_logprobs"][1])
    with pytest.raises(DatasetError, match="no column 'nope'"):
        score(frame, column="nope", engine=tiny_engine, progress=False)


def test_each_row_is_a_request_of_its_own(rows, tiny_engine, monkeypatch):
    """The engine sees every row under a request id of its own (its abort and progress are per row), and
    two calls never share one."""
    from logprobe.datasets import score

    seen = []
    stream = tiny_engine.stream

    def recording(requests, k):  # the engine's one path: a request answered whole drains it (k None)
        seen.append([r.request_id for r in requests])
        return stream(requests, k)

    monkeypatch.setattr(tiny_engine, "stream", recording)
    score([r["text"] for r in rows[:12] if r["text"]], engine=tiny_engine, progress=False)
    score(["one more row", "and another"], engine=tiny_engine, progress=False)
    ids = [rid for call in seen for rid in call]
    assert len(seen) == 2 and len(ids) == len(set(ids)) == sum(map(len, seen)) >= 12


def test_bad_input_is_refused(tmp_path):
    def refused(text: str, name: str = "in.jsonl", **kw):
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        with pytest.raises(DatasetError) as info:
            read_rows(str(path), **kw)
        return info.value.message

    assert "no column 'text'" in refused('{"body": "a"}\n') and "'body'" in refused('{"body": "a"}\n')
    for empty in ("", "\n\n"):  # no row, so no column: the file is empty, not "no column 'text' ... (none)"
        assert refused(empty).endswith("in.jsonl: the file is empty: there are no rows to score")
    assert "row 1 of column 'text' is int, not text" in refused('{"text": "a"}\n{"text": 5}\n')
    assert "row 0 of column 'text' is null" in refused('{"other": 1}\n{"text": "b"}\n')
    assert "line 2 is not JSON" in refused('{"text": "a"}\n{oops\n')
    assert "--context-column" in refused('{"text": "a"}\n', context_column="ctx")
    assert "ids must be unique" in refused('{"text": "a", "i": 1}\n{"text": "b", "i": 1}\n', id_column="i")
    assert "unknown file type '.xlsx'" in refused("x", name="in.xlsx")
    assert "cannot read" in refused("not parquet", name="in.parquet")
    with pytest.raises(DatasetError, match="cannot read"):
        read_rows(str(tmp_path / "missing.csv"))


def test_without_the_data_extra_says_what_to_install(monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now fails
    with pytest.raises(DatasetError, match=r"needs pyarrow: in your checkout of logprobe, pip install -e '\.\[data\]' "
                       r"\(installed from a package index: pip install 'logprobe\[data\]'\)"):
        read_rows(str(tmp_path / "x.jsonl"))


def test_remote_retries_and_refusals(monkeypatch):
    import httpx

    from logprobe.client import http

    waits, calls = [], []

    async def no_sleep(self, seconds):
        waits.append(seconds)

    # the scorer's own waits between attempts only (asyncio.sleep itself serves httpx, anyio and the rest)
    monkeypatch.setattr(http.ScoreClient, "back_off", no_sleep)
    answers = [httpx.Response(429, headers={"Retry-After": "7"}, json={"error": {"message": "busy"}}),
               httpx.Response(503, json={"error": {"message": "draining"}}),
               httpx.Response(200, json={"data": [{"num_tokens": 1, "logprob": -1.5, "mean_logprob": -1.5,
                                                   "perplexity": math.exp(1.5)}]})]

    def handler(request):
        calls.append(request)
        return answers.pop(0)

    scorer = RemoteScorer(["http://a", "http://b"], model="tiny", transport=httpx.MockTransport(handler))
    table = scorer.score([Row(0, "x", "hello")])
    assert table.column("logprob").to_pylist() == [-1.5] and len(calls) == 3
    assert waits[0] >= 7 and {c.url.host for c in calls} == {"a", "b"}

    def refuse(request):
        return httpx.Response(401, json={"error": {"message": "Incorrect API key provided", "code": "invalid_api_key"}})

    with pytest.raises(DatasetError, match="refused: http://a/v1/score answered 401: Incorrect API key"):
        RemoteScorer(["http://a"], model="tiny", transport=httpx.MockTransport(refuse)).score([Row(0, "x", "hello")])
    asyncio.run(asyncio.sleep(0))


CONVERSATIONS = [[{"role": "user", "content": "Where do dolphins live?"},
                  {"role": "assistant", "content": "In the sea."}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"},
                  {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"},
                  {"role": "assistant", "content": "Six, of course."}]]


def conversation_file(tmp_path, fmt, tokenizer):
    """Conversations and, for each, one list of ids per scored token (the reply and its end of turn)."""
    rng = np.random.default_rng(2)
    records = []
    for i, messages in enumerate(CONVERSATIONS):
        reply = tokenizer(messages[-1]["content"], add_special_tokens=False).input_ids
        asked = [rng.integers(0, len(tokenizer), rng.integers(0, 6)).tolist() for _ in range(len(reply) + 1)]
        records.append({"key": f"c{i}", "chat": messages, "ids": asked})
    path = tmp_path / f"chats.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif fmt == "csv":
        import csv

        with open(path, "w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["key", "chat", "ids"])
            writer.writerows([r["key"], json.dumps(r["chat"]), json.dumps(r["ids"])] for r in records)
    else:
        pq.write_table(pa.Table.from_pylist(records), path)
    return str(path), records


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_conversations_and_ids_per_position(fmt, tiny_engine, tiny_server, client, reference, tokenizer, tmp_path):
    """--messages-column and --ids-column: each row is /v1/score's answer to its conversation with its ids,
    in process and through a server, against the float64 reference; the ids' numbers are list columns."""
    path, records = conversation_file(tmp_path, fmt, tokenizer)
    options = ScoreOptions(tokens=True, asked=True)
    read = job.ReadOptions(id_column="key", messages_column="chat", ids_column="ids")
    outputs = []
    for name, scorer in (("local", InProcessScorer(tiny_engine, options)),
                         ("remote", RemoteScorer([tiny_server], model="tiny", options=options))):
        out = str(tmp_path / f"{name}.parquet")
        assert job.run(path, out, scorer, options, read, progress="none") == len(records)
        table = pq.read_table(out)
        assert table.schema.field("asked_logprobs").type == pa.list_(pa.list_(pa.float64()))
        assert table.schema.field("asked_ranks").type == pa.list_(pa.list_(pa.int64()))
        outputs.append({r["id"]: r for r in table.to_pylist()})
    for record in records:
        api = client.post("/v1/score", json={"model": "tiny", "messages": record["chat"],
                                              "logprob_token_ids": record["ids"]}).json()["data"][0]
        text = tokenizer.apply_chat_template(record["chat"], tokenize=False)
        full = tokenizer(text, add_special_tokens=False).input_ids
        ref = reference.logprobs(full).numpy()
        start = len(full) - 1 - len(api["token_ids"])  # the reply and <|im_end|>; "\n" follows
        for got in outputs:
            row = got[record["key"]]
            assert row["token_ids"] == api["token_ids"] == full[start:len(full) - 1]
            np.testing.assert_allclose(row["token_logprobs"], api["token_logprobs"], atol=TOL)
            rows = np.arange(start - 1, len(full) - 2)
            np.testing.assert_allclose(row["token_logprobs"], ref[rows, row["token_ids"]], atol=TOL)
            for ids, values, position in zip(record["ids"], row["asked_logprobs"], rows):
                np.testing.assert_allclose(values, ref[position, ids] if ids else [], atol=TOL)
            assert [len(r) for r in row["asked_ranks"]] == [len(ids) for ids in record["ids"]]


def test_conversation_rows_go_batch_rows_a_request(client, tiny_engine):
    """Over --url, conversation rows go `batch_rows` to a request, in /v1/score's `conversations`, with the
    numbers of each conversation sent alone; with --skip-invalid a batch the server refuses (one reply
    whose first characters share a token with the template's) is sent again a row at a time, and only
    that row gets the error."""
    import httpx

    bodies = []

    def handler(request):
        body = json.loads(request.content)
        bodies.append(body)
        r = client.post(request.url.path, json=body)
        return httpx.Response(r.status_code, content=r.content, headers={"content-type": "application/json"})

    bad = CONVERSATIONS[0][:1] + [{"role": "assistant", "content": "\n\nIn the sea."}]
    talks = CONVERSATIONS + [bad] + CONVERSATIONS
    rows = [Row(i, f"c{i}", talk[-1]["content"], messages=talk) for i, talk in enumerate(talks)]
    options = ScoreOptions(tokens=True, skip_invalid=True)
    scorer = RemoteScorer(["http://a"], model="tiny", options=options, batch_rows=2, concurrency=1,
                          transport=httpx.MockTransport(handler))
    table = scorer.score(rows).to_pylist()
    # [c0, c1] and [bad, c3] in `conversations`; the second refused, then bad and c3 alone; c4 alone (the rest)
    assert [b.get("conversations") or b["messages"] for b in bodies] == [talks[:2], talks[2:4], talks[2], talks[3],
                                                                         talks[4]]
    assert [r["error"] is None for r in table] == [True, True, False, True, True]
    assert "tokens run across the start" in table[2]["error"]
    for row, talk in zip(table, talks):
        if talk is bad:
            continue
        alone = client.post("/v1/score", json={"model": "tiny", "messages": talk}).json()["data"][0]
        assert row["token_ids"] == alone["token_ids"]
        np.testing.assert_allclose(row["token_logprobs"], alone["token_logprobs"], atol=TOL)
    bodies.clear()  # without the refused row: 4 conversations in 2 requests
    scorer.score(rows[:2] + rows[3:])
    assert [len(b["conversations"]) for b in bodies] == [2, 2]


def test_conversation_rows_refused(tmp_path, tiny_engine):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"chat": [{"role": "user", "content": "hi"}]}) + "\n"
                    + json.dumps({"chat": "not json"}) + "\n")
    with pytest.raises(DatasetError, match="row 1 of column 'chat' is text that is not JSON"):
        read_rows(str(path), messages_column="chat")
    path.write_text(json.dumps({"chat": [{"role": "user", "content": "hi"}], "ids": [[1]]}) + "\n")
    with pytest.raises(DatasetError, match="no assistant message to score"):
        job.run(str(path), str(tmp_path / "o.parquet"), InProcessScorer(tiny_engine, ScoreOptions()),
                ScoreOptions(), job.ReadOptions(messages_column="chat"), progress="none")
    options = ScoreOptions(asked=True, skip_invalid=True)
    path.write_text(json.dumps({"text": "a b c", "ids": [[1]]}) + "\n" + json.dumps({"text": "a", "ids": [[5]]}) + "\n")
    out = str(tmp_path / "skip.parquet")
    job.run(str(path), out, InProcessScorer(tiny_engine, options), options, job.ReadOptions(ids_column="ids"),
            progress="none")
    rows = pq.read_table(out).to_pylist()
    assert "position lists" in rows[0]["error"] and rows[1]["error"] is None and len(rows[1]["asked_logprobs"]) == 1
    path.write_text(json.dumps({"text": "a", "ids": [1, 2]}) + "\n")
    with pytest.raises(DatasetError, match="not an array of token-id arrays"):
        read_rows(str(path), ids_column="ids")


def test_python_client_scores_a_conversation(tiny_server, client):
    """logprobe.client.score_conversation and score(logprob_token_ids=...) over HTTP: the API's numbers."""
    from logprobe.client import score, score_conversation

    question = CONVERSATIONS[0][:1]
    got = score_conversation(tiny_server, "tiny", question, replies=["In the sea.", "On land."], timeout=600)
    want = client.post("/v1/score", json={"model": "tiny", "messages": question,
                                          "replies": ["In the sea.", "On land."]}).json()["data"]
    assert [s.raw["message_index"] for s in got] == [1, 1]
    for s, entry in zip(got, want):
        assert s.token_ids.tolist() == entry["token_ids"] and abs(s.logprob - entry["logprob"]) < 1e-4
        np.testing.assert_allclose(s.logprobs, entry["token_logprobs"], atol=TOL)  # a pass or the prefix cache
    (text,) = score(tiny_server, "tiny", "a b", logprob_token_ids=[[5], [6, 7]], timeout=600)
    assert [len(x) for x in text.raw["logprob_token_ids"]["logprobs"]] == [1, 2]
