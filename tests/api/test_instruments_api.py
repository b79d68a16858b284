"""The researcher's instruments over HTTP on the fake backend: `logprob_token_ids`, `position_stats`,
`top_logprobs_p` and `logprobs_mode` — parsing, refusals (streaming, caps), response shapes, and the
numbers against the fake's model (`FakeBackend.logprobs_after`)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from fake_backend import filtered_scores, top_k
from logprobe.api.app import create_app
from logprobe.backend import SamplingParams
from logprobe.config import Limits

A, B = 330, 389  # " A", " B" in SmolLM2's vocabulary
MESSAGES = [{"role": "user", "content": "Pick A or B."}]


def post(client, path="/v1/completions", **body):
    body.setdefault("model", "tiny")
    return client.post(path, json=body)


def ok(client, path="/v1/completions", **body):
    r = post(client, path, **body)
    assert r.status_code == 200, r.text
    return r.json()


def refused(client, param, path="/v1/completions", **body):
    r = post(client, path, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["code"] == "invalid_request", err
    return err["message"]


def ids_of(fake_backend, text):
    return fake_backend.tokenizer(text).input_ids


# ---- parsing and refusals ------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("value, words", [
    ("A", "Invalid type for 'logprob_token_ids': expected an array of token ids or null."),
    ([1, True], "Invalid type"), ([1.0], "Invalid type"), (["1"], "Invalid type"), ({"0": 1}, "Invalid type"),
    ([49152], "token id 49152 is outside the vocabulary of 49152 tokens (ids 0 to 49151)"), ([-1], "token id -1 is outside"),
    (list(range(129)), "at most 128 (max_logprob_token_ids), and this request has 129"),
])
def test_logprob_token_ids_refused(fake_client, fake_backend, path, value, words):
    fake_backend.reset_records()
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": MESSAGES}
    message = refused(fake_client, "logprob_token_ids", path, **body, max_tokens=1, logprob_token_ids=value)
    assert words in message
    assert not fake_backend.calls  # refused before anything reached the backend


@pytest.mark.parametrize("field, value, words", [
    ("position_stats", "yes", "Invalid type for 'position_stats': expected a boolean or null."),
    ("top_logprobs_p", 0, "expected a value greater than 0"),
    ("top_logprobs_p", 1.5, "expected a value less than or equal to 1"),
    ("top_logprobs_p", "0.9", "Invalid type for 'top_logprobs_p': expected a number or null."),
    ("logprobs_mode", "processed_logprobs", "expected 'raw', 'processed' or 'both'"),
    ("logprobs_mode", 1, "Invalid type for 'logprobs_mode'"),
])
def test_instrument_fields_refused(fake_client, field, value, words):
    assert words in refused(fake_client, field, prompt="x", max_tokens=1, **{field: value})


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field, value", [("logprob_token_ids", [A]), ("position_stats", True),
                                          ("top_logprobs_p", 0.9)])
def test_streaming_refuses_what_needs_a_whole_answer(fake_client, fake_backend, path, field, value):
    fake_backend.reset_records()
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": MESSAGES}
    message = refused(fake_client, field, path, **body, max_tokens=2, stream=True, **{field: value})
    assert "'stream': true" in message
    assert not fake_backend.calls and fake_client.get("/health").json()["tokens_held"] == 0


def test_empty_list_and_nulls_are_the_plain_request(fake_client, fake_backend):
    body = dict(prompt="The sky", max_tokens=3, logprobs=2, seed=4)
    plain = ok(fake_client, **body)
    same = ok(fake_client, **body, logprob_token_ids=[], position_stats=None, top_logprobs_p=None, logprobs_mode=None)
    assert same["choices"] == plain["choices"]
    assert set(plain["choices"][0]) == {"index", "text", "logprobs", "finish_reason", "prompt_logprobs"}
    params = fake_backend.requests[-1].params
    assert params == SamplingParams(**{**params.__dict__, **{name: getattr(SamplingParams(), name) for name in (
        "logprob_token_ids", "position_stats", "top_logprobs_p", "max_top_p_tokens", "logprobs_mode")}})
    assert not params.needs_prompt_logits and not params.needs_position_columns and not params.records_processed


def test_caps_are_in_the_model_card(fake_backend):
    with TestClient(create_app(fake_backend, Limits(max_logprob_token_ids=3, max_top_p_tokens=7))) as c:
        limits = c.get("/v1/models/tiny").json()["limits"]
        assert limits["max_logprob_token_ids"] == 3 and limits["max_top_p_tokens"] == 7
        assert "at most 3" in refused(c, "logprob_token_ids", prompt="x", logprob_token_ids=[1, 2, 3, 4])
        out = ok(c, prompt="x", max_tokens=1, logprob_token_ids=[1, 2, 3], top_logprobs_p=0.999)
        top_p = out["choices"][0]["position_stats"]["generated"]["top_p"][0]
        assert len(top_p["token_ids"]) == 7 and top_p["truncated"] is True and top_p["mass"] < 0.999
    assert Limits().max_logprob_token_ids == 128 and Limits().max_top_p_tokens == 100


@pytest.mark.parametrize("field, value", [("logprob_token_ids", [A, B]), ("position_stats", True),
                                          ("top_logprobs_p", 0.5)])
def test_prompt_positions_count_against_their_cap(fake_backend, field, value):
    with TestClient(create_app(fake_backend, Limits(max_prompt_logprob_positions=10))) as c:
        message = refused(c, field, prompt=[[5] * 6, [6] * 5], max_tokens=1, **{field: value})
        assert "11" in message and "max_prompt_logprob_positions" in message
        ok(c, prompt=[[5] * 5, [6] * 5], max_tokens=1, **{field: value})
        # prompt_logprobs, when also asked, is the field the cap names (as before)
        refused(c, "prompt_logprobs", prompt=[[5] * 11], max_tokens=1, prompt_logprobs=0, **{field: value})


# ---- shapes and numbers --------------------------------------------------------------------------


def test_logprob_token_ids_block_and_vllm_top_logprobs(fake_client, fake_backend):
    prompt = ids_of(fake_backend, "Pick one")
    asked = [A, B, 100, 101, A]  # repeats kept; 100 and 101 always tie in the fake
    out = ok(fake_client, prompt=prompt, max_tokens=3, n=2, seed=3, logprobs=1, echo=True,
             logprob_token_ids=asked, return_tokens_as_token_ids=True)
    for choice in out["choices"]:
        block = choice["logprob_token_ids"]
        assert set(block) == {"token_ids", "prompt_logprobs", "prompt_ranks", "logprobs", "ranks"}
        assert block["token_ids"] == asked
        assert block["prompt_logprobs"][0] is None and block["prompt_ranks"][0] is None
        assert len(block["prompt_logprobs"]) == len(prompt) == out["usage"]["prompt_tokens"]
        lp = choice["logprobs"]
        generated = [int(t.split(":")[1]) for t in lp["tokens"][len(prompt):]]
        assert len(block["logprobs"]) == len(block["ranks"]) == len(generated) == 3
        sequence = prompt + generated
        for pos in range(1, len(sequence)):
            row = fake_backend.logprobs_after(sequence[:pos])
            values = (block["prompt_logprobs"][pos] if pos < len(prompt) else block["logprobs"][pos - len(prompt)])
            ranks = (block["prompt_ranks"][pos] if pos < len(prompt) else block["ranks"][pos - len(prompt)])
            assert values == [float(row[t]) for t in asked]
            assert ranks == [int((row > row[t]).sum()) + 1 for t in asked]
            assert ranks[2] == ranks[3]
            top = lp["top_logprobs"][pos]
            if pos < len(prompt):  # an echoed prompt position keeps the k likeliest (vLLM)
                natural = top_k(row, 1)[0]
                assert list(top) == [f"token_id:{sequence[pos]}"] + [f"token_id:{i}" for i in natural
                                                                      if i != sequence[pos]]
            else:  # a generated one: the token, then every asked id (vLLM), whatever logprobs' k
                token = sequence[pos]
                assert list(top) == list(dict.fromkeys(f"token_id:{t}" for t in [token] + asked))
                assert top[f"token_id:{B}"] == float(row[B])


def test_position_stats_shapes_and_numbers(fake_client, fake_backend):
    prompt = ids_of(fake_backend, "The cat sat")
    out = ok(fake_client, prompt=prompt, max_tokens=4, seed=8, logprobs=0, position_stats=True,
             top_logprobs_p=0.05, return_tokens_as_token_ids=True)
    choice = out["choices"][0]
    stats = choice["position_stats"]
    assert set(stats) == {"prompt", "generated"}
    assert set(stats["prompt"]) == set(stats["generated"]) == {"entropy", "rank", "top_p"}
    generated = [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
    sequence = prompt + generated
    for section, positions, offset in (("prompt", range(len(prompt)), 0), ("generated", range(4), len(prompt))):
        s = stats[section]
        assert len(s["entropy"]) == len(s["rank"]) == len(s["top_p"]) == len(positions)
        for i in positions:
            pos = offset + i
            if pos == 0:
                assert s["entropy"][i] is None and s["rank"][i] is None and s["top_p"][i] is None
                continue
            row = fake_backend.logprobs_after(sequence[:pos]).astype(np.float64)
            probs = np.exp(row)
            assert s["entropy"][i] == pytest.approx(-(probs * row).sum(), abs=1e-5)
            assert s["rank"][i] == int((row > row[sequence[pos]]).sum()) + 1
            entry = s["top_p"][i]
            order = np.argsort(-row, kind="stable")
            count = int((np.cumsum(probs[order]) - probs[order] < 0.05).sum())
            assert entry["token_ids"] == order[:count].tolist()
            assert entry["tokens"] == [f"token_id:{t}" for t in entry["token_ids"]]
            assert entry["logprobs"] == pytest.approx(row[order[:count]].tolist(), abs=1e-6)
            assert entry["mass"] == pytest.approx(probs[order[:count]].sum(), abs=1e-6) and entry["mass"] >= 0.05
            assert entry["truncated"] is False


def test_each_block_only_when_asked(fake_client):
    only_p = ok(fake_client, prompt="x y", max_tokens=1, top_logprobs_p=0.5)["choices"][0]
    assert set(only_p["position_stats"]["prompt"]) == {"top_p"} and "logprob_token_ids" not in only_p
    only_stats = ok(fake_client, prompt="x y", max_tokens=1, position_stats=True)["choices"][0]
    assert set(only_stats["position_stats"]["generated"]) == {"entropy", "rank"}
    assert "processed_logprobs" not in only_stats
    # max_tokens 0: the prompt is read (the instruments need its positions), nothing is generated
    scored = ok(fake_client, prompt="x y", max_tokens=0, logprob_token_ids=[A], position_stats=True)["choices"][0]
    assert scored["logprob_token_ids"]["logprobs"] == [] and scored["position_stats"]["generated"]["entropy"] == []
    assert scored["logprob_token_ids"]["prompt_logprobs"][1] is not None


def test_processed_logprobs_are_the_sampling_distribution(fake_client, fake_backend):
    prompt = ids_of(fake_backend, "Once")
    body = dict(prompt=prompt, max_tokens=4, seed=2, logprobs=3, temperature=0.7, top_k=40, top_p=0.9,
                return_tokens_as_token_ids=True)
    raw = ok(fake_client, **body)["choices"][0]
    processed = ok(fake_client, **body, logprobs_mode="processed")["choices"][0]
    both = ok(fake_client, **body, logprobs_mode="both")["choices"][0]
    assert raw["text"] == processed["text"] == both["text"]  # the mode changes numbers, never tokens
    assert both["logprobs"] == raw["logprobs"] and both["processed_logprobs"] == processed["logprobs"]
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9)
    generated = [int(t.split(":")[1]) for t in raw["logprobs"]["tokens"]]
    for i, token in enumerate(generated):
        row = fake_backend.logprobs_after(prompt + generated[:i])
        scores = filtered_scores(row, params)
        dist = scores - scores.max() - np.log(np.exp(scores - scores.max()).sum())
        assert processed["logprobs"]["token_logprobs"][i] == pytest.approx(dist[token], abs=1e-6)
        for name, value in processed["logprobs"]["top_logprobs"][i].items():
            want = dist[int(name.split(":")[1])]
            assert value == (-9999.0 if np.isneginf(want) else pytest.approx(want, abs=1e-6))
        assert list(processed["logprobs"]["top_logprobs"][i]) == list(raw["logprobs"]["top_logprobs"][i])


def test_greedy_processed_is_a_point_mass(fake_client):
    out = ok(fake_client, prompt="Once", max_tokens=3, temperature=0, logprobs=2, logprobs_mode="processed")
    lp = out["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [0.0, 0.0, 0.0]
    for token, top in zip(lp["tokens"], lp["top_logprobs"]):
        assert top[token] == 0.0 and sorted(v for k, v in top.items() if k != token) == [-9999.0] * (len(top) - 1)


def test_both_with_echo_and_asked_ids(fake_client, fake_backend):
    body = dict(prompt="Hi there", max_tokens=2, seed=5, logprobs=1, echo=True, temperature=0.5, top_k=2,
                logprob_token_ids=[A, B], return_tokens_as_token_ids=True)
    both = ok(fake_client, **body, logprobs_mode="both")["choices"][0]
    processed = ok(fake_client, **body, logprobs_mode="processed")["choices"][0]
    raw = ok(fake_client, **body)["choices"][0]
    assert both["processed_logprobs"] == processed["logprobs"] and both["logprobs"] == raw["logprobs"]
    num_prompt = len(ids_of(fake_backend, "Hi there"))
    pp = both["processed_logprobs"]
    # prompt positions: no token was drawn there, the raw numbers; generated ones: top_k 2 keeps two tokens,
    # so the asked ids (unless among them) are -9999.0 in the processed distribution
    assert pp["token_logprobs"][:num_prompt] == raw["logprobs"]["token_logprobs"][:num_prompt]
    for top in pp["top_logprobs"][num_prompt:]:
        assert list(top)[1:] == [f"token_id:{A}", f"token_id:{B}"] or len(top) == 2
        assert sum(v > -9999.0 for v in top.values()) >= 1
    # the block holds raw numbers whatever the mode
    assert both["logprob_token_ids"] == raw["logprob_token_ids"] == processed["logprob_token_ids"]


def test_processed_streams(fake_client):
    body = dict(prompt="Once upon", max_tokens=5, seed=9, logprobs=2, temperature=0.8, top_p=0.8,
                logprobs_mode="processed")
    whole = ok(fake_client, **body)["choices"][0]["logprobs"]
    r = post(fake_client, **body, stream=True)
    assert r.status_code == 200
    chunks = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert sum((s["token_logprobs"] for s in streamed), []) == whole["token_logprobs"]
    assert sum((s["top_logprobs"] for s in streamed), []) == whole["top_logprobs"]


def test_chat_blocks_and_top_logprobs(fake_client, fake_backend):
    out = ok(fake_client, "/v1/chat/completions", messages=MESSAGES, max_tokens=3, seed=1, logprobs=True,
             top_logprobs=5, logprob_token_ids=[A, B, A], position_stats=True, top_logprobs_p=0.1,
             logprobs_mode="both")
    choice = out["choices"][0]
    content = choice["logprobs"]["content"]
    names = fake_backend.table.strings
    for entry in content:  # the token, then each asked id once (vLLM), instead of the 5 likeliest
        tops = [t["token"] for t in entry["top_logprobs"]]
        assert tops[0] == entry["token"] and entry["top_logprobs"][0]["logprob"] == entry["logprob"]
        assert tops[1:] == [n for n in (names[A], names[B]) if n != entry["token"]]
    assert len(choice["processed_logprobs"]["content"]) == len(content) and choice["processed_logprobs"]["refusal"] is None
    rendered = fake_backend.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    prompt = fake_backend.tokenizer(rendered, add_special_tokens=False).input_ids
    block = choice["logprob_token_ids"]
    assert len(block["prompt_logprobs"]) == len(prompt) == out["usage"]["prompt_tokens"]
    assert len(block["logprobs"]) == len(content) == len(choice["position_stats"]["generated"]["rank"])
    row = fake_backend.logprobs_after(prompt)
    assert block["logprobs"][0] == [float(row[A]), float(row[B]), float(row[A])]
    assert out["prompt_logprobs"] is None


def test_chat_drops_the_ending_turn_token_from_the_blocks(tokenizer):
    from fake_backend import FakeBackend, TinyTokenizer

    backend = FakeBackend(TinyTokenizer())
    with TestClient(create_app(backend, Limits())) as c:
        for seed in range(40):  # a reply that ends with </s> (257) before max_tokens
            out = ok(c, "/v1/chat/completions", messages=MESSAGES, max_tokens=40, seed=seed, logprobs=True,
                     logprob_token_ids=[257], position_stats=True)
            choice = out["choices"][0]
            if choice["finish_reason"] == "stop":
                break
        else:
            pytest.skip("no reply ended with its end-of-turn token")
        num = len(choice["logprobs"]["content"])
        assert out["usage"]["completion_tokens"] == num + 1
        assert len(choice["logprob_token_ids"]["logprobs"]) == len(choice["position_stats"]["generated"]["entropy"]) == num
