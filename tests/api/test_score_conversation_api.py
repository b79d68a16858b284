"""/v1/score's conversation fields (`messages`, `score_messages`, `replies`, `include_end_of_turn`) and
per-position `logprob_token_ids`: shapes and every refusal (a 400 naming the field, before any work), on the
fake backend."""

from __future__ import annotations

import copy

import pytest
from fastapi.testclient import TestClient

from fake_backend import FakeBackend
from logprobe.api.app import create_app
from logprobe.config import Limits

CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "See you."}]


def refused(client, body: dict, param: str, words: str) -> None:
    r = client.post("/v1/score", json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert words in error["message"], error["message"]


@pytest.mark.parametrize("body, param, words", [
    ({}, "input", "Missing required parameter: 'input'."),
    ({"input": "a", "messages": CHAT}, "input", "'input' and 'messages' cannot be combined"),
    ({"context": "a", "messages": CHAT}, "context", "'context' and 'messages' cannot be combined"),
    ({"input": "a", "score_messages": [1]}, "score_messages", "'score_messages' needs 'messages'"),
    ({"input": "a", "replies": ["x"]}, "replies", "'replies' needs 'messages'"),
    ({"messages": CHAT, "replies": ["x"], "score_messages": [1]}, "score_messages", "cannot be combined"),
    ({"messages": CHAT[:1]}, "messages", "no assistant message to score"),
    ({"messages": CHAT, "score_messages": [2]}, "score_messages", "messages[2] is a user message, not an assistant"),
    ({"messages": CHAT, "score_messages": [4]}, "score_messages", "4 is not a message index"),
    ({"messages": CHAT, "score_messages": [1, 1]}, "score_messages", "each message index once"),
    ({"messages": CHAT, "score_messages": []}, "score_messages", "non-empty"),
    ({"messages": CHAT, "score_messages": "1"}, "score_messages", "Invalid type for 'score_messages'"),
    ({"messages": CHAT, "replies": []}, "replies", "non-empty"),
    ({"messages": CHAT, "replies": [1]}, "replies", "Invalid type for 'replies'"),
    ({"messages": CHAT, "replies": ["x"] * 257}, "replies", "Too many replies"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages", "messages[0].role"),
    ({"messages": CHAT, "structured_outputs": {"regex": "a"}}, "structured_outputs", "not offered with 'messages'"),
    ({"messages": CHAT, "include_end_of_turn": "yes"}, "include_end_of_turn", "include_end_of_turn"),
    ({"input": "a", "logprob_token_ids": "1"}, "logprob_token_ids", "Invalid type for 'logprob_token_ids'"),
    ({"input": "a", "logprob_token_ids": [[1], 2]}, "logprob_token_ids", "Invalid type for 'logprob_token_ids'"),
    ({"input": "a", "logprob_token_ids": [[[1]], [2]]}, "logprob_token_ids", "Invalid type"),
    ({"input": "a", "logprob_token_ids": list(range(129))}, "logprob_token_ids", "at most 128 at one position"),
    ({"input": "a", "logprob_token_ids": [list(range(129))]}, "logprob_token_ids", "at most 128 at one position"),
    ({"input": "a", "logprob_token_ids": [[1]] * 32_769}, "logprob_token_ids", "at most 32768 in one request"),
    ({"input": ["a", "b"], "logprob_token_ids": [[[1]]]}, "logprob_token_ids", "1 lists of positions for 2"),
    ({"messages": CHAT, "score_messages": [1, 3], "logprob_token_ids": [[1]]}, "logprob_token_ids",
     "1 lists of positions for 2"),
    ({"input": "abc", "logprob_token_ids": [[1], [2]]}, "logprob_token_ids",
     "entry 0 has 1 tokens, and its list has 2"),
    ({"input": "a", "logprob_token_ids": [[49152]]}, "logprob_token_ids", "token id 49152 is outside"),
])
def test_refusals(fake_client, body, param, words):
    refused(fake_client, body, param, words)


def test_without_a_chat_template(tokenizer):
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    backend = FakeBackend(bare, name="bare", aliases=(), num_layers=2, d_model=64, context_length=256)
    with TestClient(create_app(backend, Limits()), raise_server_exceptions=False) as c:
        r = c.post("/v1/score", json={"model": "bare", "messages": CHAT})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert "no chat template" in r.json()["error"]["message"]


def test_shapes(fake_client, tokenizer):
    out = fake_client.post("/v1/score", json={"model": "tiny", "messages": CHAT, "score_messages": [1, 3]}).json()
    assert [e["index"] for e in out["data"]] == [0, 1] and [e["message_index"] for e in out["data"]] == [1, 3]
    for entry, content in zip(out["data"], ("Hello!", "See you.")):
        assert entry["token_ids"][:-1] == tokenizer(content, add_special_tokens=False).input_ids
        assert entry["tokens"][-1] == "<|im_end|>" and entry["num_tokens"] == len(entry["token_ids"])
    replies = fake_client.post("/v1/score", json={"model": "tiny", "messages": CHAT[:3], "replies": ["A", "B b"],
                                                  "include_end_of_turn": False}).json()["data"]
    assert [e["message_index"] for e in replies] == [3, 3]
    assert [e["token_ids"] for e in replies] == [tokenizer(r, add_special_tokens=False).input_ids for r in ("A", "B b")]
    asked = [[5], [], [7, 8, 9]]
    ids = fake_client.post("/v1/score", json={"model": "tiny", "input": [40, 41, 42], "add_bos": False,
                                              "logprob_token_ids": asked}).json()["data"][0]["logprob_token_ids"]
    assert ids["token_ids"] == asked and ids["logprobs"][0] is None and ids["ranks"][0] is None
    assert [len(x) for x in ids["logprobs"][1:]] == [0, 3] and [len(x) for x in ids["ranks"][1:]] == [0, 3]


@pytest.mark.parametrize("reply, accepted", [
    ("Hello", True), ("\nHello", True), (" Hello", True), ("\tHello", True), ("\r\nHello", True),
    ("\n\nHello", False), ("  Hello", False), (" \nHello", False), ("\n Hello", False), ("  \n  Hello", False),
    ("\n", False), (" ", False)])
def test_which_replies_that_begin_with_whitespace_are_refused(fake_client, reply, accepted):
    """docs/api.md 5.3, as written there: SmolLM2's template ends the assistant's opening with a newline,
    and its tokenizer's pre-split gives a run of white space before a word as one piece less its last
    character; a reply whose first whitespace run is one character long (or `\\r\\n`, split apart) starts a
    token, a longer run or white space alone shares its first token with the template's newline."""
    body = {"model": "tiny", "messages": CHAT[:1], "replies": [reply]}
    r = fake_client.post("/v1/score", json=body)
    if accepted:
        assert r.status_code == 200, r.text
        entry = r.json()["data"][0]
        assert "".join(entry["tokens"]).startswith(reply) and entry["text_offset"][0] == 0
    else:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages"
        assert "tokens run across the start of messages[1]'s content" in r.json()["error"]["message"]


def test_per_position_ids_without_a_bos_count_the_first_token(fake_client):
    """With `add_bos: false` the text's first token is in `tokens` (null: nothing predicts it) and not in
    `num_tokens`: the per-position lists are one per element of `tokens`, and the refusal says both counts."""
    text = "The quick brown fox jumps over the lazy dog, then naps."
    plain = fake_client.post("/v1/score", json={"model": "tiny", "input": text, "add_bos": False}).json()["data"][0]
    count = len(plain["tokens"])
    assert plain["num_tokens"] == count - 1 and plain["token_logprobs"][0] is None
    ids = fake_client.post("/tokenize", json={"model": "tiny", "prompt": text, "add_special_tokens": False}).json()
    assert ids["count"] == count
    body = {"model": "tiny", "input": text, "add_bos": False}
    refused(fake_client, {**body, "logprob_token_ids": [[6]] * (count - 1)}, "logprob_token_ids",
            f"entry 0 has {count} tokens (num_tokens {count - 1}, and the first token, which nothing predicts: "
            f"its list is read nowhere), and its list has {count - 1} position lists")
    r = fake_client.post("/v1/score", json={**body, "logprob_token_ids": [[6]] * count})
    assert r.status_code == 200, r.text
    entry = r.json()["data"][0]
    assert entry["num_tokens"] == count - 1
    asked = entry["logprob_token_ids"]
    assert len(asked["logprobs"]) == count and asked["logprobs"][0] is None and None not in asked["logprobs"][1]
    with_bos = fake_client.post("/v1/score", json={"model": "tiny", "input": text,
                                                   "logprob_token_ids": [[6]] * count}).json()["data"][0]
    assert with_bos["num_tokens"] == count == len(with_bos["logprob_token_ids"]["logprobs"])


def test_several_conversations_in_one_request(fake_client):
    """`conversations`: each conversation scored on its last assistant turn, one entry each, in order, as
    the same conversation sent alone in `messages` (what `logprobe score --messages-column --url` sends,
    --batch-rows conversations a request); per-position ids one list per entry."""
    other = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"},
             {"role": "assistant", "content": "4"}]
    body = {"model": "tiny", "conversations": [CHAT, other, CHAT[:2]], "top_logprobs": 2}
    r = fake_client.post("/v1/score", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    alone = [fake_client.post("/v1/score", json={"model": "tiny", "messages": c, "top_logprobs": 2}).json()
             for c in body["conversations"]]
    assert len(got["data"]) == 3
    for k, (entry, one) in enumerate(zip(got["data"], alone)):
        assert entry["index"] == k
        assert {**entry, "index": 0} == one["data"][0]
    assert [e["message_index"] for e in got["data"]] == [3, 2, 1]
    assert got["usage"]["prompt_tokens"] == sum(one["usage"]["prompt_tokens"] for one in alone)
    asked = [[[6]] * e["num_tokens"] for e in got["data"]]
    r = fake_client.post("/v1/score", json={**body, "logprob_token_ids": asked})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, param, words", [
    ({"conversations": []}, "conversations", "non-empty array of conversations"),
    ({"conversations": CHAT}, "conversations", "conversations[0]"),
    ({"conversations": [CHAT, [{"role": "robot", "content": "x"}]]}, "conversations", "conversations[1][0].role"),
    ({"conversations": [CHAT, CHAT[:1]]}, "conversations", "'conversations[1]' has no assistant message"),
    ({"conversations": [CHAT] * 257}, "conversations", "at most 256"),
    ({"conversations": [CHAT], "messages": CHAT}, "messages", "'messages' and 'conversations' cannot be combined"),
    ({"conversations": [CHAT], "input": "a"}, "input", "cannot be combined"),
    ({"conversations": [CHAT], "replies": ["x"]}, "replies", "cannot be combined"),
    ({"conversations": [CHAT], "score_messages": [1]}, "score_messages", "cannot be combined"),
    ({"conversations": [CHAT, CHAT], "logprob_token_ids": [[[1]]]}, "logprob_token_ids", "1 lists of positions for 2"),
])
def test_several_conversations_refusals(fake_client, body, param, words):
    refused(fake_client, body, param, words)
