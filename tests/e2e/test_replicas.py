"""Replicas on Ray Serve (`logprobe serve --replicas 2`) against one process (the `server` fixture): the
same answers byte for byte, one token budget for the application, a replica killed under load, /health
and /metrics through the one address, a taken port refused, access lines and start-up warnings, the
proxy answering while every replica is saturated, and a quiet SIGTERM drain. Everything listens on 127.0.0.1; each
load loop is bounded in requests and time.

Slow: Ray clusters of two replicas, each loading the bundled model; load, a kill, saturation, a drain."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'logprobe[ray]')")
pytestmark = pytest.mark.e2e

_spec = importlib.util.spec_from_file_location("logprobe_servers", Path(__file__).parents[2] / "benchmarks" / "servers.py")
servers = importlib.util.module_from_spec(_spec)
sys.modules["logprobe_servers"] = servers
_spec.loader.exec_module(servers)

MODEL = "smollm2-135m"
# Two replicas of one torch thread each against one process of two: the same bits all the same (MKL's
# strict reproducibility mode, set on `import logprobe`; docs/cluster.md, "The same numbers").
REPLICA_FLAGS = ["--replicas", "2", "--cpus-per-replica", "1", "--ray-cpus", "2", "--alias", "smol",
                 "--drain-timeout", "600"]


@pytest.fixture(scope="module")
def cluster():
    server = servers.start(REPLICA_FLAGS, prefix="logprobe-replicas-")
    yield server
    server.terminate()


def _stable(raw: bytes) -> bytes:
    """A response body without what differs between two answers to one request (id, created)."""
    raw = re.sub(rb'"id":"(cmpl|chatcmpl)-[0-9a-f]+"', b'"id":""', raw)
    return re.sub(rb'"created":\d+', b'"created":0', raw)


BODIES = [
    ("/v1/completions", {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12,
                         "temperature": 0, "logprobs": 5, "echo": True}),
    ("/v1/completions", {"model": "smol", "prompt": ["One, two,", "Roses are"], "max_tokens": 6, "n": 2,
                         "temperature": 0.8, "seed": 7, "logprobs": 2, "stop": ["\n"]}),
    ("/v1/completions", {"model": MODEL, "prompt": "Hello world", "max_tokens": 0, "prompt_logprobs": -1}),
    ("/v1/completions", {"model": MODEL, "prompt": "Hello world", "max_tokens": 1, "temperature": 0, "prompt_logprobs": -1,
                         "vocab_encoding": "float16"}),
    ("/v1/completions", {"model": MODEL, "prompt": "A B C", "max_tokens": 2, "temperature": 0,
                         "output_residual_stream": {"layers": [0, -1], "dtype": "bfloat16"}}),
    # interventions (a patch's source pass on the replica), return_unmodified, the lens and instruments
    ("/v1/completions", {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0,
                         "logprobs": 2, "return_unmodified": True, "output_lens": {"layers": [10, -1], "top_k": 2},
                         "logprob_token_ids": [330, 389], "position_stats": True,
                         "interventions": [{"layer": 15, "op": "patch", "positions": [-1],
                                            "source": {"prompt": "The capital of Italy is"}},
                                           {"layer": 3, "op": "add", "vector": [0.01] * 576, "positions": [0]}]}),
    # A system message of its own: the template's default one is the first block of every chat prompt,
    # which the one-process server, shared with other modules, may hold in its prefix cache while a
    # fresh replica does not; a hit agrees within float32 rounding (docs/performance.md), not to the byte.
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "system", "content": "Replica check: answer."},
                                                           {"role": "user", "content": "Say hi."}],
                              "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 3,
                              "prompt_logprobs": 1}),
    ("/v1/score", {"model": MODEL, "input": ["Paris is in France.", "Paris is in Peru."], "top_logprobs": 2}),
    ("/tokenize", {"model": MODEL, "prompt": "Hello world"}),
]


@pytest.mark.parametrize("path,body", BODIES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BODIES)])
def test_the_same_bytes_as_one_process(cluster, server, path, body):
    one = httpx.post(server + path, json=body, timeout=120)
    many = httpx.post(cluster.base + path, json=body, timeout=120)
    assert one.status_code == many.status_code == 200, many.text[:500]
    assert _stable(many.content) == _stable(one.content)


def test_streams_equal_one_process(cluster, server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0, "logprobs": 3,
            "stream": True, "stream_options": {"include_usage": True}, "n": 2}

    def events(base):
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            return [_stable(line.encode()) for line in r.iter_lines() if line]

    got = events(cluster.base)
    assert got == events(server)
    assert got[-1] == b"data: [DONE]" and len(got) > 10


def test_health_and_metrics_show_every_replica(cluster):
    for _ in range(4):  # some work for the engines' counters
        assert httpx.post(cluster.base + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                          timeout=60).status_code == 200
    health = httpx.get(cluster.base + "/health", timeout=10).json()
    assert health["status"] == "ready"
    assert health["replicas"] == {"ready": 2, "reporting": 2, "target": "2"}
    deadline = time.time() + 10
    while time.time() < deadline:  # replicas report once a second
        text = httpx.get(cluster.base + "/metrics", timeout=10).text
        counts = dict(re.findall(r'^logprobe_engine_step_seconds_count\{replica="([^"]+)"\} (\S+)$', text, re.M))
        if len(counts) == 2 and sum(float(v) for v in counts.values()) >= 4:
            break
        time.sleep(0.5)
    assert len(counts) == 2, text[-2000:]
    assert sum(float(v) for v in counts.values()) >= 4  # a prefill and a decode step per request at least
    assert re.search(r'^logprobe_requests_total\{path="/v1/completions",status="200"\} \d', text, re.M)
    assert text.count("# TYPE logprobe_engine_step_seconds histogram") == 1  # one family, every replica in it


def test_everything_listens_on_loopback(cluster):
    """The local Ray's processes (GCS, raylet, agents, workers) and the Serve proxy bind 127.0.0.1 only."""
    psutil = pytest.importorskip("psutil")
    pids = set(cluster.session_pids())
    listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in pids]
    assert len(listening) >= 5  # the proxy, the GCS, the raylet's ports, workers
    assert {c.laddr.ip for c in listening} <= {"127.0.0.1", "::ffff:127.0.0.1"}, listening
    port = int(cluster.base.rsplit(":", 1)[1])
    assert any(c.laddr.port == port for c in listening)


async def _one(client: httpx.AsyncClient, base: str, stream: bool, expected: dict) -> str:
    """One request of the load; its outcome: "ok", "unavailable" (503 envelope, streamed too when the replica
    died before the first chunk, or the error event after it) or a description of anything else (a wrong
    answer, another status)."""
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0, "logprobs": 1}
    if not stream:
        r = await client.post(base + "/v1/completions", json=body)
        if r.status_code == 503:
            err = r.json()["error"]
            return "unavailable" if (err["type"], err["code"]) == ("server_error", "unavailable") else r.text
        if r.status_code != 200:
            return f"{r.status_code}: {r.text[:200]}"
        choice = r.json()["choices"][0]
        return "ok" if choice["text"] == expected["text"] else f"wrong text {choice['text']!r}"
    text, error = "", None
    async with client.stream("POST", base + "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code == 503:  # lost before its first chunk: a stream's status goes out with that chunk
            err = orjson.loads(await r.aread())["error"]
            return "unavailable" if (err["type"], err["code"]) == ("server_error", "unavailable") else str(err)
        if r.status_code != 200:
            return f"stream {r.status_code}"
        lines = [line async for line in r.aiter_lines() if line]
    for line in lines[:-1]:
        event = orjson.loads(line[len("data: "):])
        if "error" in event:
            error = event["error"]
        else:
            text += event["choices"][0]["text"]
    if lines[-1] != "data: [DONE]":
        return "stream without [DONE]"
    if error is not None:
        return "unavailable" if (error["type"], error["code"]) == ("server_error", "unavailable") else str(error)
    return "ok" if text == expected["text"] else f"wrong streamed text {text!r}"


# SmolLM2's <|endoftext|> and <|im_end|> banned: a generation that only max_tokens or its client ends
NO_END = {"0": -100, "2": -100}


def test_a_replica_killed_under_load(cluster, server):
    """kill -9 one replica while both hold a long stream and 12 clients keep them busy: requests on the
    other replica are answered correctly, those on the dead one end with 503 `unavailable` (streams with
    the error event), every held token is given back, Serve starts a new replica, and it takes traffic."""
    expected = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "The quick brown fox",
                          "max_tokens": 24, "temperature": 0, "logprobs": 1}, timeout=60).json()["choices"][0]
    before = set(cluster.session_pids_running(b"ModelReplica"))
    assert len(before) == 2
    victim = min(before)
    idle = _quiet_step_counts(cluster.base)
    assert len(idle) == 2, idle

    async def both_holding(polls: int) -> bool:
        """Whether both replicas have stepped since they were quiet: each holds a long stream, since
        nothing else has been sent to them."""
        for _ in range(polls):
            counts = await asyncio.to_thread(_step_counts, cluster.base)
            if sum(counts.get(r, 0) > n for r, n in idle.items()) == 2:
                return True
            await asyncio.sleep(1.0)
        return False

    async def load():
        outcomes, killed_at, leave = [], None, asyncio.Event()
        async with httpx.AsyncClient(timeout=600) as client:
            # long streams, one at a time, until both replicas hold one: whichever dies has a request on it
            holders = []
            for _ in range(8):
                started = asyncio.Event()
                holders.append(asyncio.create_task(_held_stream(client, cluster.base, started, leave)))
                await asyncio.wait([holders[-1], asyncio.create_task(started.wait())],
                                   return_when=asyncio.FIRST_COMPLETED)
                assert not holders[-1].done(), holders[-1].result()
                if await both_holding(polls=5):
                    break
            else:
                assert await both_holding(polls=300)

            async def worker(i):
                for _ in range(6):  # bounded: at most 6 requests a client
                    outcomes.append((time.monotonic(), await _one(client, cluster.base, i % 2 == 0, expected)))

            tasks = [asyncio.create_task(worker(i)) for i in range(12)]
            while len(outcomes) < 6 and not any(t.done() for t in tasks):  # answers flow (at any speed)
                await asyncio.sleep(0.05)
            assert not any(h.done() for h in holders)
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*tasks), 600)
            leave.set()
            held = await asyncio.wait_for(asyncio.gather(*holders), 600)
        return outcomes, killed_at, held

    outcomes, killed_at, held = asyncio.run(load())
    assert "unavailable" in held and set(held) <= {"unavailable", "left"}, held  # the victim's ended
    kinds = [o for _, o in outcomes]
    assert set(kinds) <= {"ok", "unavailable"}, [k for k in kinds if k not in ("ok", "unavailable")][:5]
    assert any(o == "ok" and t > killed_at for t, o in outcomes)  # the other kept answering

    # the victim's last report counts for STALE_S after it died: wait for two reporting replicas, one of
    # them new (Serve's replacement), both processes up, and every hold given back
    deadline = time.time() + 300
    while time.time() < deadline:
        now = set(cluster.session_pids_running(b"ModelReplica"))
        reporting = set(_step_counts(cluster.base))
        health = httpx.get(cluster.base + "/health", timeout=60).json()
        if (victim not in now and len(now) == 2 and len(reporting) == 2 and reporting - set(idle)
                and health["tokens_held"] == 0 and health["requests_running"] == 0):
            break
        time.sleep(1)
    assert victim not in now and len(now) == 2, now
    assert len(reporting) == 2 and len(reporting - set(idle)) == 1, (reporting, idle)
    (newcomer,) = reporting - set(idle)
    assert health["status"] == "ready" and health["replicas"]["ready"] == 2
    assert health["tokens_held"] == 0 and health["requests_running"] == 0

    async def after():  # the new replica takes traffic: its steps grow (Serve routes to it once it runs)
        async with httpx.AsyncClient(timeout=600) as client:
            deadline = time.time() + 300
            while time.time() < deadline:
                answers = await asyncio.gather(*[_one(client, cluster.base, False, expected) for _ in range(8)])
                assert answers == ["ok"] * 8
                if (await asyncio.to_thread(_step_counts, cluster.base)).get(newcomer, 0) > 0:
                    return True
                await asyncio.sleep(1)
        return False

    assert asyncio.run(after())


async def _held_stream(client: httpx.AsyncClient, base: str, started: asyncio.Event, leave: asyncio.Event) -> str:
    """A stream of 4,000 tokens that nothing but its client or its replica's death ends: "unavailable"
    (the error event), "left" (its client left once `leave` was set), or what else came."""
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 4000, "temperature": 0, "stream": True,
            "logit_bias": NO_END}
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return f"stream {r.status_code}"
        async for line in r.aiter_lines():
            if not line:
                continue
            if line == "data: [DONE]":
                return "finished"
            event = orjson.loads(line[len("data: "):])
            if "error" in event:
                error = event["error"]
                return "unavailable" if (error["type"], error["code"]) == ("server_error", "unavailable") else str(error)
            started.set()
            if leave.is_set():
                return "left"
    return "stream without [DONE]"


def _step_counts(base: str) -> dict[str, float]:
    """Each reporting replica's engine steps (/metrics, labelled by replica)."""
    text = httpx.get(base + "/metrics", timeout=60).text
    return {replica: float(count) for replica, count in
            re.findall(r'^logprobe_engine_step_seconds_count\{replica="([^"]+)"\} ([0-9.]+)$', text, re.M)}


def _quiet_step_counts(base: str) -> dict[str, float]:
    """The replicas' step counts once nothing runs: no request held, and the same counts in reports
    taken more than two report periods apart (a report read just before may lag the last steps)."""
    deadline = time.time() + 300
    last = None
    while time.time() < deadline:
        health = httpx.get(base + "/health", timeout=60).json()
        counts = _step_counts(base)
        if health["requests_running"] == 0 and health["in_flight"] == 0 and counts == last and len(counts) == 2:
            return counts
        last = counts
        time.sleep(2.5)
    return last or {}


def test_a_client_that_leaves_stops_its_work_on_the_replica(cluster):
    """Closing a stream (and a plain request) early cancels the replica's work through Serve: the engines
    hold nothing a moment later, long before the 2000 tokens asked for would have been generated."""
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 2000, "temperature": 0, "stream": True,
            "logit_bias": NO_END}

    def emptied() -> dict:
        deadline = time.time() + 300
        while time.time() < deadline:
            time.sleep(0.5)
            health = httpx.get(cluster.base + "/health", timeout=60).json()
            if health["in_flight"] == 0 and health["requests_running"] == 0 and health["tokens_held"] == 0:
                break
        return health

    with httpx.stream("POST", cluster.base + "/v1/completions", json=body, timeout=600) as r:
        lines = r.iter_lines()
        for _ in range(5):
            next(lines)
    health = emptied()
    assert (health["in_flight"], health["requests_running"], health["tokens_held"]) == (0, 0, 0), health

    async def leave_a_plain_request():
        async with httpx.AsyncClient(timeout=600) as client:
            call = asyncio.create_task(client.post(cluster.base + "/v1/completions", json={**body, "stream": False}))
            while (await client.get(cluster.base + "/health")).json()["in_flight"] < 1:  # on a replica
                assert not call.done(), call.result().text
                await asyncio.sleep(0.05)
            assert not call.done()
            call.cancel()

    asyncio.run(leave_a_plain_request())
    health = emptied()
    assert (health["in_flight"], health["requests_running"], health["tokens_held"]) == (0, 0, 0), health


def _budget_statuses(base: str) -> list[tuple[int, str | None, str | None]]:
    """Seven /v1/score requests of one key, one after another: (status, x-ratelimit-limit-tokens, code,
    Retry-After present)."""
    text = " ".join(["word"] * 18)
    out = []
    for _ in range(7):
        r = httpx.post(base + "/v1/score", json={"model": MODEL, "input": text}, timeout=60,
                       headers={"authorization": "Bearer budget-key"})
        code = r.json()["error"]["code"] if r.status_code != 200 else None
        out.append((r.status_code, r.headers.get("x-ratelimit-limit-tokens"), code,
                    r.headers.get("retry-after") is not None))
    return out


def test_one_token_budget_for_the_application():
    """--tokens-per-minute 60 (a token a second): each score request takes 19 tokens for good (prompt
    tokens are used); three fit, the fourth would wait ~16 s, longer than --queue-timeout: 429 with
    Retry-After, exactly as one process answers the same sequence, though the requests are spread over
    two replicas (the refill is slow enough that how fast the requests run does not matter)."""
    flags = ["--tokens-per-minute", "60", "--queue-timeout", "1", "--api-key", "budget-key"]
    one = servers.start(flags, prefix="logprobe-budget-")
    try:
        expected = _budget_statuses(one.base)
    finally:
        one.terminate()
    many = servers.start(REPLICA_FLAGS + flags, prefix="logprobe-budget-replicas-")
    try:
        got = _budget_statuses(many.base)
    finally:
        many.terminate()
    assert expected == [(200, "60", None, False)] * 3 + [(429, "60", "rate_limit_exceeded", True)] * 4
    assert got == expected


def _serve_exit(flags: list[str], limit: float = 120) -> tuple[int | None, str]:
    """(exit code, output) of `logprobe serve FLAGS`, in a session of its own; None when it is still
    running after `limit` s (then its session is killed)."""
    proc = subprocess.Popen([sys.executable, "-m", "logprobe.cli", "serve", *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    try:
        out, _ = proc.communicate(timeout=limit)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        servers.Server(proc, "", os.devnull).terminate(timeout=30)
        return None, ""


@pytest.mark.parametrize("holder,replicas", [("cluster", ["--replicas", "1"]), ("cluster", []),
                                             ("server", ["--replicas", "1"])],
                         ids=["ray-vs-ray", "one-process-vs-ray", "ray-vs-one-process"])
def test_a_taken_port_is_refused_before_ray_starts(request, holder, replicas):
    """A second deployment on the port of a running one would share it (Serve's proxy binds with
    SO_REUSEPORT) and split its connections; a --replicas server on a one-process server's port failed
    with a RayTaskError. Each is refused at once, with one line, before Ray starts (none of the holder's
    answers change)."""
    base = request.getfixturevalue(holder)
    base = base.base if holder == "cluster" else base
    port = base.rsplit(":", 1)[1]
    code, out = _serve_exit(["--port", port, *replicas])
    assert code == 2, out[-3000:]
    assert f"logprobe: 127.0.0.1:{port} is already in use" in out
    assert "Traceback" not in out and "Started Serve" not in out and "ready: serving" not in out
    assert httpx.get(base + "/health", timeout=30).json()["status"] == "ready"


def test_access_lines_and_start_up_warnings_as_in_one_process(cluster):
    """The ingress logs one `logprobe.access` line per request and the command warns that no API key is
    configured, as one process does (Ray shows the ingress's lines with its name in front)."""
    assert httpx.post(cluster.base + "/tokenize", json={"model": MODEL, "prompt": "Hi"}, timeout=60).status_code == 200
    deadline = time.time() + 30  # Ray forwards an actor's output to the driver within a second or so
    while time.time() < deadline and not any("/tokenize" in line for line in _access_lines(cluster.log_text())):
        time.sleep(0.5)
    lines = _access_lines(cluster.log_text())
    assert any('"path":"/tokenize"' in line and '"status":200' in line for line in lines), lines[-5:]
    assert any('"path":"/v1/completions"' in line for line in lines)  # the earlier tests' requests
    assert "WARNING logprobe: no API key configured" in cluster.log_text()


def _access_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "logprobe.access" in line and "Ingress" in line]


SATURATE_S = 90


def test_saturated_replicas_leave_the_proxy_answering(cluster):
    """Eight clients keep both replicas (1 torch thread each, on however few cores) busy for 90 s while
    /health, /tokenize and 1-token completions are probed one after another: no connection is dropped,
    every probe is answered 200 (each within its 120 s timeout), and Serve's proxy is the same process
    at the end. Replicas run niced (ray_app.REPLICA_NICENESS) and the proxy's health check is patient,
    so the controller does not mark a starved proxy unhealthy and kill it with its connections."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import saturation

    proxies, replicas = cluster.session_pids_running(b"ProxyActor"), set(cluster.session_pids_running(b"ModelReplica"))
    assert len(proxies) == 1 and len(replicas) == 2
    result = asyncio.run(saturation.saturate(cluster.base, SATURATE_S, clients=8, min_probes=3))
    assert result["failures"] == [], result["failures"][:10]
    assert result["finished"] > 0 and result["probes"] >= 3
    assert result["most_in_flight"] >= 2  # the engines had the load
    # nothing was replaced: no health check gave up on the proxy or a replica
    assert cluster.session_pids_running(b"ProxyActor") == proxies and set(cluster.session_pids_running(b"ModelReplica")) == replicas
    assert "health check response for proxy" not in cluster.log_text()


def test_sigterm_drains_the_application(cluster):
    """Last (it stops the module's cluster): a running stream finishes, a new request gets the 503
    envelope, the command exits 0 and leaves no Ray process behind, and stopping prints no alarm
    (Ray's "ServeController... failed ... killed by `ray.kill`" once came three times)."""
    # a stream that outlasts the wait for the drain on any machine: no end of text, and 600 s to finish
    body = {"model": MODEL, "prompt": "Count: 1, 2,", "max_tokens": 400, "temperature": 0, "stream": True,
            "logit_bias": {"0": -100, "2": -100}}

    async def main():
        async with httpx.AsyncClient(timeout=600) as client:
            async with client.stream("POST", cluster.base + "/v1/completions", json=body) as r:
                lines = r.aiter_lines()
                first = await anext(lines)
                cluster.proc.send_signal(signal.SIGTERM)
                while (await client.get(cluster.base + "/health")).json()["status"] != "draining":
                    await asyncio.sleep(0.1)  # the command has reached the ingress
                refused = await client.post(cluster.base + "/v1/completions",
                                            json={"model": MODEL, "prompt": "x", "max_tokens": 1})
                rest = [line async for line in lines if line]
        return first, rest, refused

    first, rest, refused = asyncio.run(main())
    assert first.startswith("data: ")
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "unavailable"
    assert cluster.proc.wait(timeout=60) == 0
    deadline = time.time() + 15
    while cluster.session_pids() and time.time() < deadline:
        time.sleep(0.5)
    assert cluster.session_pids() == []
    log = cluster.log_text()
    stopping = log[log.index("draining (new requests get 503"):]
    assert "killed by `ray.kill`" not in stopping and "Traceback" not in stopping, stopping[-3000:]
