"""Hostile input, fuzzed and by hand: the server never answers 500, never hangs, and every refusal is
the error envelope of API.md section 9 with the request id and the param that names the field at fault.

Every request goes through `call`, which runs it on a daemon thread and fails the test if no answer
comes within a time limit (a real guard against hangs, not a measurement after the fact).

Slow: hypothesis sends hundreds of bodies to each endpoint, and 10 MB texts.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from dataclasses import dataclass
from urllib.parse import quote

import orjson
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from logprobe.api.app import create_app
from logprobe.api.registry import BODIES
from logprobe.config import Limits

LIMITS = Limits()
VOCAB = 49152  # the tiny model runs on SmolLM2's tokenizer
MODEL_NAMES = ("tiny", "test/tiny-llama")
COMPARED_NAMES = MODEL_NAMES + ("tiny-b", "test/tiny-llama-b")  # /v1/compare runs on `pair_client`
REQUEST_ID = re.compile(r"req_[0-9a-f]{32}")
ALLOWED_STATUS = {200, 400, 404, 413, 429}
REQUEST_TIME_LIMIT = 10.0  # seconds: any ordinary request
BIG_TIME_LIMIT = 30.0  # seconds: a request that carries ~10 MB of text to tokenize (2-core test machine)
CODES = {400: {"invalid_request", "context_length_exceeded"}, 404: {"model_not_found", "not_found"},
         405: {"method_not_allowed"}, 413: {"request_too_large"}, 429: {"rate_limit_exceeded"}}
JSON = {"content-type": "application/json"}
MIB = 1024 * 1024


# --------------------------------------------------------------------------------------------------
# Requests, with a hang guard, and the checks every answer must pass


def call(client, method: str, url: str, *, body=None, raw: bytes | None = None, headers=None, params=None,
         limit: float = REQUEST_TIME_LIMIT):
    """One request, answered within `limit` seconds or the test fails. `body` is sent as JSON (big ints
    as exact digits, text as UTF-8); `raw` as the bytes given."""
    if body is not None:
        raw = json.dumps(body, ensure_ascii=False, allow_nan=False).encode("utf-8")
        headers = {**JSON, **(headers or {})}
    box = {}

    def run():
        try:
            box["response"] = client.request(method, url, content=raw, headers=headers, params=params)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            box["exc"] = exc

    started = time.monotonic()
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(limit)
    assert not worker.is_alive(), f"{method} {url} gave no answer within {limit:g} s (hang)"
    if "exc" in box:
        raise box["exc"]
    response = box["response"]
    response.started, response.finished = started, time.monotonic()
    response.elapsed_s = response.finished - started
    return response


def check_answer(r, allowed=ALLOWED_STATUS) -> dict | None:
    """Any answer: never 500, a known status, a request id; a success parses, a refusal is exactly the
    envelope. Returns the envelope's `error` (None on success)."""
    assert r.status_code != 500, f"500: {r.text[:2000]}"
    assert r.status_code in allowed, f"unexpected status {r.status_code}: {r.text[:2000]}"
    rid = r.headers.get("x-request-id")
    assert rid is not None and REQUEST_ID.fullmatch(rid), f"bad x-request-id {rid!r}"
    if r.status_code == 200:
        check_success(r)
        return None
    return check_envelope(r)


def check_success(r) -> None:
    ctype = r.headers.get("content-type", "")
    if ctype.startswith("text/event-stream") and r.text.startswith("event: "):  # /v1/responses: named events
        blocks = [block.split("\n") for block in r.text.split("\n\n") if block]
        assert all(len(b) == 2 and b[0].startswith("event: ") and b[1].startswith("data: ") for b in blocks), r.text
        kinds = [orjson.loads(b[1][len("data: "):])["type"] for b in blocks]
        assert kinds == [b[0][len("event: "):] for b in blocks] and "error" not in kinds, r.text[-1000:]
        assert kinds[-1] in ("response.completed", "response.incomplete"), r.text[-500:]
        return
    if ctype.startswith("text/event-stream"):
        events = [line[len("data: "):] for line in r.text.split("\n\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text[-500:]
        for event in events[:-1]:
            chunk = orjson.loads(event)
            assert isinstance(chunk, dict) and "error" not in chunk, f"error inside a 200 stream: {event[:1000]}"
        return
    assert ctype.startswith("application/json"), ctype
    data = orjson.loads(r.content)
    assert isinstance(data, dict), r.text[:1000]
    if data.get("object") == "response":  # OpenAI's response object always has `error`, null on success
        assert data["error"] is None and data["status"] in ("completed", "incomplete"), r.text[:1000]
        return
    assert "error" not in data, r.text[:1000]


def check_envelope(r) -> dict:
    assert r.headers.get("content-type", "").startswith("application/json"), r.headers.get("content-type")
    assert "Traceback" not in r.text and 'File "' not in r.text, r.text[:2000]
    data = r.json()
    assert isinstance(data, dict) and set(data) == {"error", "request_id"}, r.text[:2000]
    err = data["error"]
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, r.text[:2000]
    assert isinstance(err["message"], str) and err["message"].strip()
    assert err["param"] is None or isinstance(err["param"], str)
    assert REQUEST_ID.fullmatch(data["request_id"]), data["request_id"]
    assert r.headers["x-request-id"] == data["request_id"]
    assert err["code"] in CODES.get(r.status_code, ()), (r.status_code, err)
    assert err["type"] == ("rate_limit_error" if r.status_code == 429 else "invalid_request_error"), err
    return err


def param_root(param: str) -> str:
    """`stream_options.include_usage` -> `stream_options`; `messages[0].role` -> `messages`."""
    return re.split(r"[.\[]", param, maxsplit=1)[0]


def refuse(client, path: str, body=None, *, raw=None, headers=None, status=400, param="<any>",
           code=None, limit=REQUEST_TIME_LIMIT, method="POST") -> dict:
    """Send, and check the answer is the envelope with this status (and param / code when given)."""
    r = call(client, method, path, body=body, raw=raw, headers=headers, limit=limit)
    err = check_answer(r, allowed=ALLOWED_STATUS | {405})
    assert r.status_code == status, f"expected {status}, got {r.status_code}: {r.text[:2000]}"
    if param != "<any>":
        assert err["param"] == param, f"param {err['param']!r}, expected {param!r}: {err}"
    if code is not None:
        assert err["code"] == code, err
    return err


# --------------------------------------------------------------------------------------------------
# The endpoints and their fields, from the modules themselves


@dataclass(frozen=True)
class Spec:
    known: frozenset  # fields the endpoint reads
    unimplemented: dict  # OpenAI fields taken only at neutral values
    required: frozenset


REQUIRED_UNLESS = {"/v1/score": {"input"}, "/tokenize": {"prompt"}}  # required unless `messages` is sent
SPECS = {path: Spec(frozenset(model.implemented_fields()), model.neutral_values(),
                    frozenset(model.required_fields()) | REQUIRED_UNLESS.get(path, set()))
         for path, model in BODIES.items()}
SKIPPED_PATHS = ("/", "/static")


def schema_operations(app) -> list[tuple[str, str]]:
    ops = []
    for path, item in app.openapi()["paths"].items():
        if path in SKIPPED_PATHS or path.startswith("/static"):
            continue
        ops += [(path, method.upper()) for method in item if method in ("get", "post", "put", "delete", "patch")]
    return sorted(ops)


# The same factory as the `client` fixture, without an engine: enough for the schema at collection time.
# test_schema_operations_are_the_served_ones checks that it matches the served app's schema.
OPERATIONS = schema_operations(create_app(None))
POST_PATHS = [p for p, m in OPERATIONS if m == "POST"]
GET_PATHS = [p for p, m in OPERATIONS if m == "GET"]


def test_schema_operations_are_the_served_ones(fake_client):
    assert schema_operations(fake_client.app) == OPERATIONS
    assert set(POST_PATHS) == set(SPECS), "a POST endpoint without a fuzz spec (add it to SPECS)"
    assert {"/v1/models", "/v1/models/{model}", "/health", "/tokenizer_info"} <= set(GET_PATHS)


# --------------------------------------------------------------------------------------------------
# Strategies

HOSTILE_INTS = [0, 1, -1, 4, 5, 16, 17, 100, 101, VOCAB - 1, VOCAB, 10**9, 10**12, 2**31, 2**53 + 1,
                2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, -(2**70), 10**30]
HOSTILE_FLOATS = [0.0, -0.0, 0.5, 1.0, 2.0, 2.0000001, 1e308, -1e308, 5e-324, 1e-300, 1.5, -1.0, 9.3e18]
HOSTILE_STRINGS = ["", " ", "\x00", "tiny", "test/tiny-llama", "TINY", " tiny", "null", "true", "1", "-1",
                   "\u202e\u200b", "🙂🙂🙂", "a" * 300, "{{ raise_exception('x') }}", "</s><|im_end|>",
                   "\x00logprobe-part-0000000000000000-0\x00", "float16", "base64", "user"]

json_scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(), st.sampled_from(HOSTILE_INTS),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(HOSTILE_FLOATS),
    st.text(max_size=10), st.sampled_from(HOSTILE_STRINGS),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
token_ids = st.one_of(st.integers(0, VOCAB - 1), st.integers(0, VOCAB - 1),
                      st.sampled_from([-1, VOCAB, 10**12, 2**63 - 1, True, 1.0, 2.5]))
texts = st.text(max_size=12) | st.sampled_from(HOSTILE_STRINGS)
prompts = st.one_of(
    texts, st.lists(texts, min_size=1, max_size=3),
    st.lists(token_ids, min_size=1, max_size=6),
    st.lists(st.lists(token_ids, min_size=0, max_size=4), min_size=1, max_size=3),
    json_values,
)
residual = st.one_of(
    st.lists(st.integers(-4, 3), min_size=1, max_size=3),
    st.fixed_dictionaries({"layers": st.lists(st.integers(-4, 3), max_size=3) | json_values},
                          optional={"dtype": st.sampled_from(["float32", "float16", "bfloat16", "int8"]) | json_values,
                                    "encoding": st.sampled_from(["base64", "json", "hex"]) | json_values,
                                    "bogus": json_values}),
    json_values,
)
content_parts = st.lists(st.fixed_dictionaries({"type": st.just("text") | json_values, "text": texts | json_values}),
                         max_size=3)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]) | st.sampled_from(["tool", "", "USER"]) | json_values,
     "content": texts | content_parts | json_values},
    optional={"name": texts | json_values, "tool_calls": json_values},
)
messages = st.lists(message, min_size=1, max_size=3) | json_values


def small_int(lo, hi):
    return st.integers(lo, hi) | json_values


def boolean():
    return st.booleans() | json_values


FIELD_VALUES = {
    "model": st.sampled_from(MODEL_NAMES) | json_values,
    "models": st.lists(st.sampled_from(COMPARED_NAMES) | texts, max_size=3) | json_values,
    "prompt": prompts,
    "input": prompts,
    "context": texts | st.lists(texts, max_size=3) | json_values,
    "messages": messages,
    "tokens": st.lists(token_ids, max_size=6) | json_values,
    "max_tokens": small_int(0, 4),
    "max_completion_tokens": small_int(0, 4),
    "n": small_int(0, 4),
    "temperature": st.floats(0, 2) | json_values,
    "top_p": st.floats(0, 1) | json_values,
    "top_k": small_int(-2, VOCAB + 1),
    "seed": st.integers(-(2**63), 2**63 - 1) | json_values,
    "stop": texts | st.lists(texts, max_size=5) | json_values,
    "echo": boolean(),
    "stream": boolean(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": boolean(),
                                                          "continuous_usage_stats": st.booleans(),
                                                          "bogus": json_values}) | json_values,
    "top_logprobs": small_int(0, 6),
    "prompt_logprobs": small_int(-1, 6),
    "vocab_encoding": st.sampled_from(["float32", "float16", "int8"]) | json_values,
    "output_residual_stream": residual,
    "output_lens": residual,
    "add_special_tokens": boolean(),
    "return_tokens_as_token_ids": boolean(),
    "add_bos": boolean(),
    "user": texts | json_values,
}


def field_values(path: str, name: str):
    if name == "logprobs":  # an int on completions, a bool on chat
        return boolean() if path == "/v1/chat/completions" else small_int(0, 6)
    unimplemented = SPECS[path].unimplemented
    if name in unimplemented:
        return st.sampled_from(list(unimplemented[name])) | json_values
    return FIELD_VALUES.get(name, json_values)


def _integral(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value == int(value))


def tame(path: str, body: dict) -> None:
    """Keep accepted requests cheap (the caps refuse large values fast; small ones in range would
    generate): generation lengths and n over 4 become 4, a missing max_tokens becomes 2 (chat's default
    is the rest of the context), and a whole-vocabulary prompt_logprobs uses the dense encoding."""
    for name in ("max_tokens", "max_completion_tokens", "n"):
        value = body.get(name)
        if _integral(value) and 4 < value < 10**6:
            body[name] = 4
    if path == "/v1/chat/completions" and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 2
    if path == "/v1/responses" and _integral(body.get("max_output_tokens")) and 4 < body["max_output_tokens"] < 10**6:
        body["max_output_tokens"] = 4
    if path == "/v1/responses" and body.get("max_output_tokens") is None:
        body["max_output_tokens"] = 2
    if path == "/v1/completions" and body.get("max_tokens") is None:
        body["max_tokens"] = 2  # the default, 16, times n times the prompts, is slow on 2 cores
    if _integral(body.get("prompt_logprobs")) and body["prompt_logprobs"] == -1 and "vocab_encoding" not in body:
        body["vocab_encoding"] = "float16"


# Values each field accepts: most fields of a generated body take one, and a few (0 to 2) take a value
# from FIELD_VALUES / json_values instead, so that bodies get past the first check and reach the
# tokenizer, the caps and the engine.
texts_ok = st.text(min_size=1, max_size=12)
prompts_ok = st.one_of(texts_ok, st.lists(texts_ok, min_size=1, max_size=3),
                       st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
                       st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4), min_size=1, max_size=3))
messages_ok = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]),
     "content": st.text(max_size=20) | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                        "text": st.text(max_size=8)}), max_size=2)},
    optional={"name": st.text(max_size=5)}), min_size=1, max_size=3)
layers_ok = st.lists(st.integers(-3, 2), min_size=1, max_size=3)
VALID_VALUES = {
    "model": st.sampled_from(MODEL_NAMES),
    "models": st.lists(st.sampled_from(COMPARED_NAMES), min_size=2, max_size=2),
    "prompt": prompts_ok,
    "input": prompts_ok,
    "context": st.text(max_size=12),
    "messages": messages_ok,
    "tokens": st.lists(st.integers(0, VOCAB - 1), max_size=6),
    "max_tokens": st.integers(0, 4),
    "max_completion_tokens": st.integers(0, 4),
    "n": st.integers(1, 4),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1, exclude_min=True),
    "top_k": st.integers(-1, VOCAB + 1),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": texts_ok | st.lists(texts_ok, max_size=4),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "continuous_usage_stats": st.booleans()}),
    "top_logprobs": st.integers(0, 5),
    "prompt_logprobs": st.integers(-1, 5),
    "vocab_encoding": st.sampled_from(["float32", "float16"]),
    "output_residual_stream": layers_ok | st.fixed_dictionaries(
        {"layers": layers_ok}, optional={"dtype": st.sampled_from(["float32", "float16", "bfloat16"]),
                                         "encoding": st.sampled_from(["base64", "json"])}),
    "output_lens": layers_ok | st.fixed_dictionaries({"layers": layers_ok}, optional={"top_k": st.integers(0, 5)}),
    "user": st.text(max_size=8),
}


RESPONSES_VALUES = {  # /v1/responses' own shapes of fields other routes share by name
    "input": texts_ok | st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant"]),
         "content": st.text(max_size=20) | st.lists(st.fixed_dictionaries(
             {"type": st.sampled_from(["input_text", "output_text"]), "text": st.text(max_size=8)}), max_size=2)},
        optional={"type": st.just("message")}), min_size=1, max_size=3),
    "include": st.just(["message.output_text.logprobs"]),
    "max_output_tokens": st.integers(1, 4),
    "stream_options": st.fixed_dictionaries({}, optional={"include_obfuscation": st.booleans()}),
    "text": st.fixed_dictionaries({}, optional={"format": st.sampled_from([
        {"type": "text"}, {"type": "json_object"},
        {"type": "json_schema", "name": "a", "schema": {"type": "object"}, "strict": True}])}),
    "instructions": st.text(max_size=12),
    "previous_response_id": st.none(),
    "prompt_cache_key": st.text(max_size=8),
    "safety_identifier": st.text(max_size=8),
}


def valid_values(path: str, name: str):
    if path == "/v1/responses" and name in RESPONSES_VALUES:
        return RESPONSES_VALUES[name]
    if name == "logprobs":
        return st.booleans() if path == "/v1/chat/completions" else st.integers(0, 5)
    unimplemented = SPECS[path].unimplemented
    if name in unimplemented:
        return st.sampled_from(list(unimplemented[name]))
    return VALID_VALUES.get(name, st.booleans())  # the remaining fields are booleans


@st.composite
def post_bodies(draw, path: str):
    if draw(st.integers(0, 19)) == 0:
        return draw(json_values)  # not always an object
    spec = SPECS[path]
    usual = spec.required | ({"model"} & spec.known)
    names = [name for name in sorted(usual) if draw(st.integers(0, 19))]  # usually sent
    optional = sorted(spec.known - spec.required - {"model"})
    if optional:
        names += draw(st.lists(st.sampled_from(optional), unique=True, max_size=6))
    if spec.unimplemented and not draw(st.integers(0, 4)):
        names.append(draw(st.sampled_from(sorted(spec.unimplemented))))
    hostile = set(draw(st.lists(st.sampled_from(names), unique=True, max_size=2))) if names else set()
    body = {name: draw(field_values(path, name) if name in hostile else valid_values(path, name)) for name in names}
    if not draw(st.integers(0, 11)):  # a field this endpoint does not have
        key = draw(st.text(min_size=1, max_size=12) | st.sampled_from(["", "model ", "__proto__", "a.b", "Prompt",
                                                                        "logprob", "tokens", "messages"]))
        body.setdefault(key, draw(json_values))
    tame(path, body)
    return body


FUZZ = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
EXAMPLES = {"/v1/completions": 400, "/v1/chat/completions": 300, "/v1/responses": 300, "/v1/score": 400,
            "/tokenize": 300, "/detokenize": 300}


def check_param(path: str, body: dict, r, err: dict) -> None:
    """A refusal of an object body names a field the client sent (or a path into one), or a required
    field it left out, or nothing."""
    spec = SPECS[path]
    param = err["param"]
    sent_unknown = [k for k in body if k not in spec.known and k not in spec.unimplemented]
    if sent_unknown:  # an unknown field is never served
        assert r.status_code == 400, (r.status_code, err)
    if r.status_code == 404 and path == "/v1/compare":
        assert err["code"] == "model_not_found" and param == "models", err
        assert not set(body["models"]) <= set(COMPARED_NAMES)
        return
    if r.status_code == 404:
        assert err["code"] == "model_not_found" and param == "model", err
        assert body.get("model") not in MODEL_NAMES
        return
    if param is None or param in body:
        return
    if param_root(param) in body:
        return  # a path into a field: `messages[0].role`, `stream_options.include_usage`
    assert param in spec.required and body.get(param) is None, (
        f"param {param!r} names no field of the request (sent: {sorted(body)}): {err}")


def fuzz_post_bodies(client, path: str, examples: int) -> None:
    @settings(max_examples=examples, **FUZZ)
    @given(body=post_bodies(path))
    def run(body):
        r = call(client, "POST", path, body=body)
        err = check_answer(r)
        if not isinstance(body, dict):
            assert r.status_code == 400 and err["param"] is None and "JSON object" in err["message"], r.text
            return
        if err is None:
            spec = SPECS[path]
            for k, value in body.items():  # only known fields, and unimplemented ones at neutral values
                assert k in spec.known or value in spec.unimplemented[k], k
            if "model" in body and body["model"] is not None:
                assert body["model"] in MODEL_NAMES
            return
        check_param(path, body, r, err)

    run()


@pytest.mark.parametrize("path", POST_PATHS)
def test_fuzz_post_bodies(fake_client, pair_client, path):
    fuzz_post_bodies(pair_client if path == "/v1/compare" else fake_client, path, EXAMPLES.get(path, 100))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/score"])
def test_fuzz_post_bodies_on_the_engine(client, path):
    """A tenth of the examples through the real engine: the accepted bodies of every shape (sampling
    settings, stops, residual layers, whole-vocabulary prompts) run its steps without a 500."""
    fuzz_post_bodies(client, path, EXAMPLES[path] // 10)


path_pieces = st.text(max_size=20) | st.sampled_from(list(MODEL_NAMES) + ["", "tiny/", "test/tiny-llama/",
                                                                           "../v1/models", "tiny?x=1", "\x00"])
queries = st.lists(st.tuples(st.text(max_size=8), st.text(max_size=8)), max_size=4)


@pytest.mark.parametrize("path", GET_PATHS)
def test_fuzz_get(fake_client, path):
    @settings(max_examples=150, **FUZZ)
    @given(piece=path_pieces, query=queries)
    def run(piece, query):
        assume(piece not in (".", ".."))  # dot segments are resolved by the fake_client
        assume("%" not in piece)  # starlette's TestClient percent-decodes the path twice
        assume("\n" not in piece)  # starlette's route regex: `.` stops at a newline, `$` matches before one
        url = path.replace("{model}", quote(piece, safe=""))
        r = call(fake_client, "GET", url, params=query)
        err = check_answer(r)
        named = [value for key, value in query if key == "model"]  # /tokenizer_info's own parameter, the last one
        if path == "/tokenizer_info" and named and named[-1] not in MODEL_NAMES:
            assert r.status_code == 404 and err["code"] == "model_not_found" and err["param"] == "model", r.text
        elif "{model}" not in path:
            assert r.status_code == 200, r.text  # any other query string is ignored
        elif piece in MODEL_NAMES:
            assert r.status_code == 200 and r.json()["id"] == "test/tiny-llama", r.text
        else:
            assert r.status_code == 404 and err["code"] == "model_not_found" and err["param"] == "model", r.text

    run()


UNDECLARED = [(path, method) for path in sorted({p for p, _ in OPERATIONS})
              for method in ("GET", "POST", "PUT", "DELETE", "PATCH") if (path, method) not in OPERATIONS]


@pytest.mark.parametrize("path,method", UNDECLARED)
def test_undeclared_methods_are_405_envelopes(fake_client, path, method):
    refuse(fake_client, path.replace("{model}", "tiny"), raw=b"{}", headers=JSON, method=method, status=405,
           param=None, code="method_not_allowed")


def test_the_hang_guard_fires():
    """`call` fails a request that does not answer in time (so the guard above is real)."""
    import asyncio

    from fastapi.testclient import TestClient
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def slow(request):
        await asyncio.sleep(3)
        return PlainTextResponse("late")

    with pytest.raises(AssertionError, match="hang"):
        call(TestClient(Starlette(routes=[Route("/slow", slow)])), "GET", "/slow", limit=0.5)


# --------------------------------------------------------------------------------------------------
# Hand-written hostile bodies

CMPL = {"model": "tiny", "prompt": "The sky is", "max_tokens": 1}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
SCORE = {"model": "tiny", "input": "The sky is blue"}
COMPARE = {"models": ["tiny", "tiny-b"], "input": "The sky is blue"}
BASES = {"/v1/completions": CMPL, "/v1/chat/completions": CHAT, "/v1/score": SCORE, "/v1/compare": COMPARE,
         "/tokenize": {"model": "tiny", "prompt": "hi"}, "/detokenize": {"model": "tiny", "tokens": [1, 2]},
         "/v1/tree": {"model": "tiny", "prompt": "The sky is", "depth": 1, "branches": 2},
         "/v1/responses": {"model": "tiny", "input": "hi", "max_output_tokens": 1}}

# One wrong-typed value per field; the refusal must name the field. The test below checks that every
# field of each endpoint is here, so a new field gets covered.
WRONG_TYPES = {
    "/v1/completions": {
        "model": 5, "prompt": {"text": "a"}, "max_tokens": "4", "temperature": "hot", "top_p": [1], "n": True,
        "stream": "yes", "logprobs": {"k": 1}, "echo": 0, "stop": 5, "seed": True, "user": 1, "top_k": 1.5,
        "prompt_logprobs": "all", "vocab_encoding": 16, "output_residual_stream": 3, "output_lens": 3,
        "add_special_tokens": "false", "return_tokens_as_token_ids": 1, "stream_options": [True],
        "logprob_token_ids": "330", "position_stats": 1, "top_logprobs_p": "0.9", "logprobs_mode": ["raw"],
        "interventions": {"layer": 1}, "return_unmodified": "yes",
        "logit_bias": [1], "allowed_token_ids": "1", "bad_words": "no", "min_tokens": "2", "ignore_eos": "yes",
        "skip_special_tokens": "no",
        "response_format": "json", "structured_outputs": 5,
    },
    "/v1/chat/completions": {
        "model": ["tiny"], "messages": {"role": "user", "content": "hi"}, "max_tokens": False,
        "max_completion_tokens": "1", "temperature": "0", "top_p": {}, "n": 1.5,
        "stream": 1, "stop": {"a": 1}, "seed": "42", "logprobs": 1, "top_logprobs": True, "user": [],
        "top_k": "5", "prompt_logprobs": [0], "vocab_encoding": True, "output_residual_stream": "all",
        "output_lens": "all",
        "return_tokens_as_token_ids": "true", "stream_options": "usage",
        "logprob_token_ids": [[330]], "position_stats": "true", "top_logprobs_p": [0.5], "logprobs_mode": True,
        "interventions": "add", "return_unmodified": 1,
        "logit_bias": "5", "allowed_token_ids": [True], "bad_words": [1], "min_tokens": 1.5, "ignore_eos": 1,
        "skip_special_tokens": 0,
        "response_format": ["json_object"], "structured_outputs": "regex",
    },
    "/v1/score": {
        "model": True, "input": 5, "context": 5, "add_bos": "true", "top_logprobs": "3", "position_stats": 1,
        "output_residual_stream": True, "return_tokens_as_token_ids": 0, "user": {"id": 1},
        "response_format": 1, "structured_outputs": [], "messages": {"role": "user", "content": "hi"},
        "score_messages": "1", "replies": "yes", "include_end_of_turn": "no", "logprob_token_ids": "330",
        "conversations": {"role": "user"},
    },
    "/v1/compare": {
        "models": "tiny", "input": 5, "context": ["x"], "add_special_tokens": "true", "return_tokens_as_token_ids": 1,
        "stream": "no", "user": 3, "align": 5,
    },
    "/tokenize": {"model": 5, "prompt": [1, 2], "add_special_tokens": 1, "messages": "hi",
                  "add_generation_prompt": "yes"},
    "/detokenize": {"model": {}, "tokens": "1 2"},
    "/v1/tree": {
        "model": 5, "prompt": {"text": "a"}, "messages": "hi", "depth": "2", "branches": 2.5, "branch_p": "0.9",
        "temperature": [1], "top_p": "1", "top_k": 1.5, "logit_bias": [1], "response_format": "json",
        "structured_outputs": 5, "allowed_token_ids": "1", "bad_words": "no", "add_special_tokens": 0,
        "return_tokens_as_token_ids": "yes", "user": 5,
    },
    "/v1/responses": {
        "model": 5, "input": 5, "include": "message.output_text.logprobs", "instructions": ["x"],
        "max_output_tokens": "4", "parallel_tool_calls": "yes", "previous_response_id": 5,
        "prompt_cache_key": 1, "safety_identifier": {}, "store": "no", "stream": 1, "stream_options": "x",
        "temperature": "0", "text": "json", "top_logprobs": "2", "top_p": [1], "user": 5, "top_k": 1.5,
        "seed": "1",
    },
}
# Fields that only are read next to another one.
NEEDS = {"stream_options": {"stream": True}}


def test_wrong_type_table_covers_every_field():
    for path, table in WRONG_TYPES.items():
        assert set(table) == set(SPECS[path].known), path


@pytest.mark.parametrize("path,field,value", [(p, f, v) for p, t in WRONG_TYPES.items() for f, v in t.items()])
def test_wrong_type_names_the_field(fake_client, path, field, value):
    body = {**BASES[path], **NEEDS.get(field, {}), field: value}
    refuse(fake_client, path, body, param=field, code="invalid_request")


BOOL_FOR_INT = [
    ("/v1/completions", "max_tokens"), ("/v1/completions", "n"), ("/v1/completions", "logprobs"),
    ("/v1/completions", "top_k"), ("/v1/completions", "seed"), ("/v1/completions", "prompt_logprobs"),
    ("/v1/chat/completions", "max_tokens"), ("/v1/chat/completions", "max_completion_tokens"),
    ("/v1/chat/completions", "top_logprobs"), ("/v1/chat/completions", "n"), ("/v1/score", "top_logprobs"),
    ("/v1/completions", "min_tokens"), ("/v1/chat/completions", "min_tokens"),
]


@pytest.mark.parametrize("path,field", BOOL_FOR_INT)
@pytest.mark.parametrize("value", [True, False])
def test_booleans_are_not_integers(fake_client, path, field, value):
    body = {**BASES[path], field: value}
    if field == "top_logprobs" and path.endswith("chat/completions"):
        body["logprobs"] = True
    err = refuse(fake_client, path, body, param=field)
    assert err["message"] == f"Invalid type for '{field}': expected a number or null."


@pytest.mark.parametrize("path,field,value", [
    ("/v1/completions", "max_tokens", -(2**70)),
    ("/v1/completions", "logprobs", 10**9),
    ("/v1/completions", "logprobs", -(2**63)),
    ("/v1/completions", "n", -1),
    ("/v1/completions", "n", 2**63 - 1),
    ("/v1/completions", "n", 10**30),
    ("/v1/completions", "temperature", 1e308),
    ("/v1/completions", "temperature", -5e-324),
    ("/v1/completions", "top_p", -1e308),
    ("/v1/completions", "top_p", 5e-324 * 0),
    ("/v1/completions", "top_k", 2**64),
    ("/v1/completions", "seed", -(2**70)),
    ("/v1/completions", "seed", 2**63),
    ("/v1/completions", "prompt_logprobs", -(2**63)),
    ("/v1/completions", "prompt_logprobs", 10**9),
    ("/v1/completions", "max_tokens", 2.5),
    ("/v1/completions", "n", 1.000001),
    ("/v1/chat/completions", "max_completion_tokens", -1),
    ("/v1/chat/completions", "n", 0),
    ("/v1/chat/completions", "n", 10**9),
    ("/v1/chat/completions", "temperature", 2.0000001),
    ("/v1/chat/completions", "seed", 10**30),
    ("/v1/score", "top_logprobs", 10**9),
    ("/v1/score", "top_logprobs", -1),
])
def test_out_of_range_numbers_name_the_field(fake_client, path, field, value):
    body = {**BASES[path], field: value}
    err = refuse(fake_client, path, body, param=field, code="invalid_request")
    assert f"'{field}'" in err["message"]


@pytest.mark.parametrize("path,field,value", [
    ("/v1/completions", "max_tokens", 2**63 - 1),
    ("/v1/completions", "max_tokens", 2**63),
    ("/v1/completions", "max_tokens", 10**30),
    ("/v1/completions", "max_tokens", 1e308),
    ("/v1/chat/completions", "max_tokens", 10**30),
    ("/v1/chat/completions", "max_completion_tokens", 2**63),
])
def test_huge_max_tokens_is_a_context_error(fake_client, path, field, value):
    """The real bound of max_tokens is the context, whatever the integer's size: the error says so."""
    err = refuse(fake_client, path, {**BASES[path], field: value}, param=field, code="context_length_exceeded")
    assert err["message"].startswith("This model's maximum context length is")
    as_parsed = int(orjson.loads(json.dumps(value)))  # integers past 64 bits reach the server as floats
    assert str(as_parsed) in err["message"]


def test_integral_floats_are_integers(fake_client):
    r = call(fake_client, "POST", "/v1/completions", body={**CMPL, "max_tokens": 1.0, "n": 2.0, "logprobs": 0.0})
    check_answer(r)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/score"])
@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"nan", b"inf", b"1e400", b"-1e999",
                                     b"0x10", b"01", b"+1", b".5", b"1.", b"undefined"])
def test_non_json_number_literals(fake_client, path, literal):
    field = b"top_logprobs" if path == "/v1/score" else b"temperature"
    base = orjson.dumps(BASES[path])
    raw = base[:-1] + b',"' + field + b'":' + literal + b"}"
    err = refuse(fake_client, path, raw=raw, headers=JSON, param=None, code="invalid_request")
    assert "not valid JSON" in err["message"]


def _nested(depth: int, open_: bytes = b"[", close: bytes = b"]", leaf: bytes = b"") -> bytes:
    return open_ * depth + leaf + close * depth


@pytest.mark.parametrize("path,field", [("/v1/completions", b"prompt"), ("/v1/chat/completions", b"messages"),
                                        ("/v1/score", b"input"), ("/detokenize", b"tokens")])
@pytest.mark.parametrize("depth", [64, 65, 200, 5000, 100_000])
def test_deep_nesting_is_refused(fake_client, path, field, depth):
    """The top object is level 1: a field holding `depth` nested arrays nests depth + 1 levels."""
    raw = b'{"model":"tiny","' + field + b'":' + _nested(depth, leaf=b"1") + b"}"
    err = refuse(fake_client, path, raw=raw, headers=JSON, code="invalid_request")
    assert err["param"] is None and "max_json_depth" in err["message"], err


@pytest.mark.parametrize("path,field", [("/v1/completions", b"prompt"), ("/v1/chat/completions", b"messages"),
                                        ("/v1/score", b"input")])
def test_nesting_at_the_cap_reaches_field_checks(fake_client, path, field):
    raw = b'{"model":"tiny","' + field + b'":' + _nested(63, leaf=b"1") + b"}"  # 64 levels: allowed
    refuse(fake_client, path, raw=raw, headers=JSON, param=field.decode())


@pytest.mark.parametrize("depth", [65, 3000])
def test_deep_objects_in_a_free_field(fake_client, depth):
    raw = orjson.dumps(CMPL)[:-1] + b',"user":' + _nested(depth, b'{"a":', b"}", b"1") + b"}"
    err = refuse(fake_client, "/v1/completions", raw=raw, headers=JSON, param=None)
    assert "max_json_depth" in err["message"]


def test_brackets_inside_strings_are_not_nesting(fake_client):
    r = call(fake_client, "POST", "/v1/completions", body={**CMPL, "prompt": "[{" * 60, "user": "[" * 5000})
    check_answer(r)
    assert r.status_code == 200, r.text


TEXT_FIELD = {"/v1/completions": "prompt", "/v1/chat/completions": "user", "/v1/score": "input",
              "/tokenize": "prompt"}


@pytest.mark.parametrize("path", sorted(TEXT_FIELD))
@pytest.mark.parametrize("bad", [b"\xff\xfe", b"\xc0\xaf", b"\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
                                 b"\xe2\x82"])
def test_invalid_utf8_in_a_string_is_refused(fake_client, path, bad):
    field = TEXT_FIELD[path]
    rest = orjson.dumps({k: v for k, v in BASES[path].items() if k != field})
    raw = rest[:-1] + b',"' + field.encode() + b'":"a' + bad + b'"}'
    refuse(fake_client, path, raw=raw, headers=JSON, param=None, code="invalid_request")


@pytest.mark.parametrize("raw", [
    b'{"model":"tiny","pr\xffompt":"a"}',  # in a key
    b'\xef\xbb\xbf{"model":"tiny","prompt":"a"}',  # a UTF-8 byte-order mark
    '{"model":"tiny","prompt":"a"}'.encode("utf-16"),
    b'{"model":"tiny","prompt":"\\ud800"}',  # a lone surrogate escape
    b'{"model":"tiny","prompt":"\\udc00\\ud800"}',
    b'{"model":"tiny","prompt":"a\x00"}',  # a raw control character in a string
    b'{"model":"tiny",\x00"prompt":"a"}',
    b'{"model":"tiny","prompt":"a"} {"model":"tiny"}',
    b'{"model":"tiny","prompt":"a",}',
    b"{'model':'tiny','prompt':'a'}",
    b'{"model":"tiny","prompt":"a" // comment\n}',
    b'{"model":"tiny","prompt":"a"',
    b" ",
    b"\n\t",
])
def test_malformed_json_bytes(fake_client, raw):
    refuse(fake_client, "/v1/completions", raw=raw, headers=JSON, param=None, code="invalid_request")


def test_escaped_surrogate_pair_is_fine(fake_client):
    r = call(fake_client, "POST", "/v1/completions", raw=b'{"model":"tiny","prompt":"\\ud83d\\ude00","max_tokens":1}',
             headers=JSON)
    check_answer(r)
    assert r.status_code == 200


@pytest.mark.parametrize("path", POST_PATHS)
@pytest.mark.parametrize("raw", [b"", b"null", b"[]", b'[{"model":"tiny"}]', b"1", b'"{}"', b"true"])
def test_bodies_that_are_not_objects(fake_client, path, raw):
    refuse(fake_client, path, raw=raw, headers=JSON, param=None, code="invalid_request")


@pytest.mark.parametrize("path", POST_PATHS)
def test_non_json_content_types(fake_client, path):
    for raw, ctype in [(b"model=tiny&prompt=a", "application/x-www-form-urlencoded"),
                       (b"--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\ntiny\r\n--b--\r\n",
                        "multipart/form-data; boundary=b"),
                       (b"<xml/>", "application/xml")]:
        r = call(fake_client, "POST", path, raw=raw, headers={"content-type": ctype})
        err = check_answer(r, allowed={400, 415})
        assert err["param"] is None, err


@pytest.mark.parametrize("path", POST_PATHS)
@pytest.mark.parametrize("ctype", ["text/plain", None, "application/octet-stream"])
def test_json_under_another_content_type(fake_client, pair_client, path, ctype):
    """The contract is silent: accepting the JSON or refusing the type (415) are both fine, 500 is not."""
    headers = {"content-type": ctype} if ctype else {}
    client = pair_client if path == "/v1/compare" else fake_client
    r = call(client, "POST", path, raw=orjson.dumps(BASES[path]), headers=headers)
    err = check_answer(r, allowed={200, 415})
    assert err is None or err["param"] is None


def test_duplicate_keys(fake_client):
    # Last one wins (orjson, Python's json) or the body is refused: either way the bad value is caught.
    err = refuse(fake_client, "/v1/completions", raw=b'{"model":"tiny","prompt":"a","max_tokens":1,"max_tokens":-1}',
                 headers=JSON)
    assert err["param"] == "max_tokens"
    err = refuse(fake_client, "/v1/completions", raw=b'{"model":"tiny","prompt":"a","model":"nope"}', headers=JSON,
                 status=404)
    assert err["param"] == "model"
    r = call(fake_client, "POST", "/v1/completions",
             raw=b'{"model":"tiny","prompt":"a","max_tokens":-1,"max_tokens":1}',
             headers=JSON)
    err = check_answer(r)
    assert err is None or err["param"] == "max_tokens"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {**CMPL, "prompt": ["a", ""]}, "prompt"),
    ("/v1/completions", {**CMPL, "prompt": [[]]}, "prompt"),
    ("/v1/completions", {**CMPL, "prompt": [[1], []]}, "prompt"),
    ("/v1/completions", {**CMPL, "prompt": [""] * 3}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [[]]}, "messages"),
    ("/v1/score", {**SCORE, "input": ""}, "input"),
    ("/v1/score", {**SCORE, "input": []}, "input"),
    ("/v1/score", {**SCORE, "input": [[]]}, "input"),
    ("/v1/score", {**SCORE, "input": ["a", ""]}, "input"),
    ("/v1/score", {**SCORE, "input": "", "add_bos": False}, "input"),
    ("/v1/score", {**SCORE, "input": ["a", "b"], "context": []}, "context"),
    ("/v1/score", {**SCORE, "input": ["a", "b"], "context": ["x", "y", "z"]}, "context"),
    ("/v1/score", {**SCORE, "context": ["x", 1]}, "context"),
    ("/tokenize", {"prompt": None}, "prompt"),
])
def test_empty_inputs(fake_client, path, body, param):
    refuse(fake_client, path, body, param=param)


def test_empty_but_valid_tokenizer_inputs(fake_client):
    r = call(fake_client, "POST", "/tokenize", body={"prompt": ""})
    assert check_answer(r) is None and r.json()["tokens"] == []
    r = call(fake_client, "POST", "/detokenize", body={"tokens": []})
    assert check_answer(r) is None and r.json()["prompt"] == ""


@pytest.mark.parametrize("path,field,value", [
    ("/v1/completions", "prompt", [VOCAB]),
    ("/v1/completions", "prompt", [10**12]),
    ("/v1/completions", "prompt", [2**63 - 1]),
    ("/v1/completions", "prompt", [-(2**63)]),
    ("/v1/completions", "prompt", [1, 2, -5]),
    ("/v1/completions", "prompt", [[1, 2], [3, VOCAB]]),
    ("/v1/completions", "prompt", [2**63]),  # beyond int64: arrives as a float
    ("/v1/completions", "prompt", [1, True]),
    ("/v1/completions", "prompt", [[1], [False]]),
    ("/v1/completions", "prompt", [1, None]),
    ("/v1/completions", "prompt", [1, [2]]),
    ("/v1/completions", "prompt", ["a", 1]),
    ("/v1/score", "input", [VOCAB]),
    ("/v1/score", "input", [10**12]),
    ("/v1/score", "input", [-1]),
    ("/v1/score", "input", [[1], [1, VOCAB]]),
    ("/v1/score", "input", [True]),
    ("/v1/score", "input", [1.0]),
    ("/detokenize", "tokens", [VOCAB]),
    ("/detokenize", "tokens", [10**12]),
    ("/detokenize", "tokens", [-1]),
    ("/detokenize", "tokens", [2**63 - 1]),
    ("/detokenize", "tokens", [True]),
    ("/detokenize", "tokens", [[1]]),
])
def test_token_ids_outside_the_vocabulary(fake_client, path, field, value):
    refuse(fake_client, path, {**BASES[path], field: value}, param=field, code="invalid_request")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/score"])
def test_null_model_is_a_missing_model(fake_client, path):
    err = refuse(fake_client, path, {**BASES[path], "model": None}, param="model")
    assert err["message"] == "Missing required parameter: 'model'."


@pytest.mark.parametrize("path", POST_PATHS)
@pytest.mark.parametrize("name", ["gpt-4o", "", " tiny", "tiny ", "tiny\x00", "test/tiny-llama/", "../tiny",
                                  "🙂", "a" * 5000])
def test_unknown_model_is_404_everywhere(fake_client, pair_client, path, name):
    if path == "/v1/compare":  # two names; either unknown one is the 404
        body, client, param = {**BASES[path], "models": ["tiny", name]}, pair_client, "models"
    else:
        body, client, param = {**BASES[path], "model": name}, fake_client, "model"
    err = refuse(client, path, body, status=404, param=param, code="model_not_found")
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", POST_PATHS)
@pytest.mark.parametrize("name", ["temprature", "", "Model", "model ", "\x00", "a.b", "__proto__", "🙂",
                                  "messages[0]", "x" * 300])
def test_unknown_field_is_named(fake_client, path, name):
    if name in SPECS[path].known or name in SPECS[path].unimplemented:
        pytest.skip("a field of this endpoint")
    err = refuse(fake_client, path, {**BASES[path], name: 1}, param=name, code="invalid_request")
    assert err["message"] == f"Unrecognized request argument supplied: {name}"


@pytest.mark.parametrize("path,name", [(p, n) for p in ("/v1/completions", "/v1/chat/completions")
                                       for n in sorted(SPECS[p].unimplemented)])
def test_unimplemented_fields_at_a_hostile_value(fake_client, path, name):
    err = refuse(fake_client, path, {**BASES[path], name: {"nested": [1e308, None]}}, param=name)
    assert "does not implement" in err["message"]


@pytest.mark.parametrize("path,body,param", [
    # A refusal inside an object-valued field names that field (or a path into it), never a bare inner
    # key that the client did not send at the top level.
    ("/v1/completions", {**CMPL, "stream": True, "stream_options": {"include_usage": True, "bogus": 1}},
     "stream_options"),
    ("/v1/completions", {**CMPL, "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": 1}}, "stream_options"),
    ("/v1/completions", {**CMPL, "output_residual_stream": {"layers": [0], "bogus": 1}}, "output_residual_stream"),
    ("/v1/score", {**SCORE, "output_residual_stream": {"layers": [0], "model": "x"}}, "output_residual_stream"),
    ("/v1/completions", {**CMPL, "output_residual_stream": {"layers": [0], "dtype": {}}}, "output_residual_stream"),
    ("/v1/completions", {**CMPL, "output_residual_stream": {"layers": [0], "encoding": 7}}, "output_residual_stream"),
    ("/v1/completions", {**CMPL, "output_residual_stream": [2**70]}, "output_residual_stream"),
    ("/v1/completions", {**CMPL, "output_residual_stream": [True]}, "output_residual_stream"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": None}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a"}, "b"]}, "messages"),
])
def test_errors_inside_object_fields_name_the_field(fake_client, path, body, param):
    err = refuse(fake_client, path, body)
    assert err["param"] is not None and param_root(err["param"]) == param, (
        f"param {err['param']!r} does not point into {param!r}: {err}")


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {**CMPL, "stream_options": {}}, "stream_options"),
    ("/v1/completions", {**CMPL, "stream": True, "prompt_logprobs": 0}, "prompt_logprobs"),
    ("/v1/completions", {**CMPL, "stream": True, "output_residual_stream": [0]}, "output_residual_stream"),
    ("/v1/completions", {**CMPL, "vocab_encoding": "float16"}, "vocab_encoding"),
    ("/v1/completions", {**CMPL, "stop": ["a", ""]}, "stop"),
    ("/v1/completions", {**CMPL, "stop": ""}, "stop"),
    ("/v1/completions", {**CMPL, "stop": [None]}, "stop"),
])
def test_field_combinations(fake_client, path, body, param):
    refuse(fake_client, path, body, param=param, code="invalid_request")


# Sampling settings at the edge of their ranges: accepted values must sample (or be refused with the
# field's name), never crash the engine step.

TINY_SAMPLING = [("temperature", 5e-324), ("temperature", 1e-300), ("temperature", 1e-45), ("temperature", 1e-39),
                 ("top_p", 5e-324), ("top_p", 1e-300), ("top_p", 1e-46)]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field,value", TINY_SAMPLING)
def test_tiny_positive_temperature_and_top_p(client, path, field, value):
    body = {**BASES[path], field: value, "max_tokens": 2, "logprobs": path.endswith("chat/completions") or 1}
    r = call(client, "POST", path, body=body)
    err = check_answer(r)
    assert r.status_code in (200, 400), r.text
    if err is not None:
        assert err["param"] == field, err


@pytest.mark.parametrize("field,value", [("temperature", 1e-300), ("top_p", 5e-324)])
def test_a_hostile_request_does_not_fail_its_neighbours(client, field, value):
    """A request running next to one with extreme sampling settings still gets its answer."""
    box = {}
    neighbour = threading.Thread(daemon=True, target=lambda: box.update(r=call(
        client, "POST", "/v1/completions", body={**CMPL, "prompt": "hello", "max_tokens": 200, "seed": 1},
        limit=BIG_TIME_LIMIT)))
    neighbour.start()
    admission = client.app.state.admission
    while admission.running == 0 and neighbour.is_alive():  # the neighbour is admitted (and decoding)
        time.sleep(0.01)
    r = call(client, "POST", "/v1/completions", body={**CMPL, field: value})
    check_answer(r)
    neighbour.join(BIG_TIME_LIMIT + 5)
    assert "r" in box, "the neighbour request failed or hung"
    check_answer(box["r"])
    assert box["r"].status_code == 200, f"the neighbour got {box['r'].status_code}: {box['r'].text[:500]}"


# Context length: the param is the field the client sent that is too long.


def test_chat_context_error_names_the_length_field_that_was_sent(fake_client):
    err = refuse(fake_client, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 1000},
                 code="context_length_exceeded")
    assert err["param"] == "max_completion_tokens"
    err = refuse(fake_client, "/v1/chat/completions", {**CHAT, "max_tokens": 1000}, code="context_length_exceeded")
    assert err["param"] == "max_tokens", f"the fake_client sent max_tokens, not {err['param']!r}: {err}"


def test_score_position_cap_names_a_score_field(fake_client):
    # 200 inputs of 200 tokens: 40,200 scored positions (with BOS) > 32,768.
    err = refuse(fake_client, "/v1/score", {"model": "tiny", "input": [[7] * 200] * 200}, code="invalid_request")
    assert "32768" in err["message"]
    assert err["param"] in SPECS["/v1/score"].known, (
        f"param {err['param']!r} is not a field of /v1/score (expected 'input'): {err}")


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {**CMPL, "prompt": [5] * 5_000_000}, "prompt"),  # ~10 MB of token ids
    ("/v1/completions", {**CMPL, "prompt": [[5]] * 1_000_000}, "prompt"),  # a million prompts
    ("/v1/score", {**SCORE, "input": [[5]] * 1_000_000}, "input"),
    ("/v1/completions", {**CMPL, "stop": ["x" * MIB] * 5}, "stop"),
])
def test_wide_bodies(fake_client, path, body, param):
    refuse(fake_client, path, body, param=param, limit=BIG_TIME_LIMIT)


def test_long_stop_strings_do_not_slow_generation(client):
    r = call(client, "POST", "/v1/completions", body={**CMPL, "max_tokens": 4, "stop": ["x" * (3 * MIB)] * 4})
    check_answer(r)
    assert r.status_code == 200


# Body size.


@pytest.mark.parametrize("path", POST_PATHS)
def test_17_mib_body_is_413(fake_client, path):
    raw = b'{"model":"tiny","user":"' + b"a" * (17 * MIB) + b'"}'
    refuse(fake_client, path, raw=raw, headers=JSON, status=413, param=None, code="request_too_large")


def test_17_mib_chunked_body_without_content_length_is_413(fake_client):
    def chunks():
        yield b'{"model":"tiny","prompt":"'
        for _ in range(17):
            yield b"a" * MIB
        yield b'"}'

    r = call(fake_client, "POST", "/v1/completions", raw=chunks(), headers=JSON)
    assert "content-length" not in {k.lower() for k in r.request.headers}
    err = check_answer(r)
    assert r.status_code == 413 and err["code"] == "request_too_large" and err["param"] is None


def test_body_just_under_the_cap_is_read(fake_client):
    raw = b'{"model":"tiny","prompt":"a","max_tokens":1,"user":"'
    raw += b"u" * (LIMITS.max_body_bytes - len(raw) - 2) + b'"}'
    assert len(raw) == LIMITS.max_body_bytes
    r = call(fake_client, "POST", "/v1/completions", raw=raw, headers=JSON)
    check_answer(r)
    assert r.status_code == 200


# Ten megabytes of text: refused on context length, in bounded time, without stalling other clients.

TEN_MB = 10 * MIB
BIG_TEXT = [
    ("/v1/completions", lambda: {**CMPL, "prompt": "hello world " * (TEN_MB // 12)}, 400, "prompt"),
    ("/v1/completions", lambda: {**CMPL, "prompt": "a" * TEN_MB}, 400, "prompt"),  # one 10 MB word
    ("/v1/chat/completions", lambda: {**CHAT, "messages": [{"role": "user", "content": "ab " * (TEN_MB // 3)}]},
     400, "messages"),
    ("/v1/score", lambda: {**SCORE, "input": "hello world " * (TEN_MB // 12)}, 400, "input"),
    ("/tokenize", lambda: {"prompt": "hello world " * (TEN_MB // 12)}, 200, None),
]


class HeldTokenizer:
    """The backend's tokenizer, except that tokenizing a text of over a megabyte first waits (up to
    `wait_s`) until the test has had another request answered: with tokenizing off the event loop that
    request is answered meanwhile, with it on the loop it cannot be (the wait then runs out)."""

    def __init__(self, tokenizer, wait_s: float):
        self._tokenizer, self._wait_s = tokenizer, wait_s
        self.started, self.probe_answered = threading.Event(), threading.Event()
        self.answered_while_held: bool | None = None

    def __call__(self, text, *args, **kwargs):
        if isinstance(text, str) and len(text) > MIB:
            self.started.set()
            self.answered_while_held = self.probe_answered.wait(self._wait_s)
        return self._tokenizer(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.mark.parametrize("path,make,status,param", BIG_TEXT,
                         ids=["completions", "completions-one-word", "chat", "score", "tokenize"])
def test_ten_megabyte_text(fake_client, fake_backend, monkeypatch, path, make, status, param):
    """The big request is answered (refused on context length before it is tokenized, or tokenized),
    and while its text is being tokenized the server answers another request: the tokenizer runs off
    the event loop. No timing is asserted: the tokenizer holds the big text until the other request
    has been answered, which only a free event loop can do."""
    held = HeldTokenizer(fake_backend.tokenizer, wait_s=BIG_TIME_LIMIT)
    monkeypatch.setattr(fake_backend, "tokenizer", held)
    box = {}
    worker = threading.Thread(target=lambda: box.update(r=call(fake_client, "POST", path, body=make(),
                                                                 limit=3 * BIG_TIME_LIMIT)), daemon=True)
    worker.start()
    tokenizes = status == 200
    if tokenizes:
        assert held.started.wait(BIG_TIME_LIMIT), "the 10 MB text never reached the tokenizer"
    probe = call(fake_client, "GET", "/health", limit=BIG_TIME_LIMIT)
    held.probe_answered.set()
    worker.join(3 * BIG_TIME_LIMIT + 5)
    assert "r" in box, "the big request failed or hung"
    r = box["r"]
    err = check_answer(r)
    assert r.status_code == status, r.text[:1000]
    if status == 400:
        assert err["code"] == "context_length_exceeded" and err["param"] == param, err
        assert not held.started.is_set(), "a text that cannot fit the context was tokenized"
    assert probe.status_code == 200
    if tokenizes:
        assert held.answered_while_held, "GET /health was not answered while 10 MB were tokenized: the event loop was blocked"
