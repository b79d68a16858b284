"""Each streamed choice ends exactly once; behaviour that code written for vLLM relies on; small
messages; the client's dense reader. The streamed endings against the engine's own answers on the tiny
model (`client`); the rest on the fake backend (`fake_client`)."""

from __future__ import annotations

import base64
import json
import logging

import numpy as np
import pytest
from fastapi.testclient import TestClient

from logprobe.api.app import create_app
from logprobe.client import dense_prompt_logprobs

from test_streaming_and_chat import events  # noqa: E402 (same folder)


def stop_ending_only(texts: list[str], which: int = 0) -> str:
    """A stop string found early in texts[which] and in none of the others (so that choice ends first
    and the others go on)."""
    text = texts[which]
    for length in (4, 3, 5, 6):
        for start in range(1, max(1, len(text) - length)):
            s = text[start:start + length]
            if s.strip() and all(s not in t for i, t in enumerate(texts) if i != which) and text.find(s) == start:
                return s
    pytest.skip("no distinguishing stop string in these texts")


def choice_endings(chunks, index_of=lambda ch: ch["index"]):
    """{choice index: [position in the stream of each chunk with a finish_reason]}, and the position of
    each choice's last chunk."""
    ends, last = {}, {}
    for pos, c in enumerate(chunks):
        for ch in c["choices"]:
            last[index_of(ch)] = pos
            if ch["finish_reason"] is not None:
                ends.setdefault(index_of(ch), []).append(pos)
    return ends, last


def test_streamed_choices_end_exactly_once(client):
    base = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 20, "seed": 7, "n": 2, "logprobs": 1}
    plain = client.post("/v1/completions", json=base).json()
    stop = stop_ending_only([c["text"] for c in plain["choices"]])
    body = {**base, "stop": [stop]}
    plain = client.post("/v1/completions", json=body).json()
    assert plain["choices"][0]["finish_reason"] == "stop"
    assert len(plain["choices"][1]["logprobs"]["tokens"]) > len(plain["choices"][0]["logprobs"]["tokens"])
    chunks = events(client, "/v1/completions", {**body, "stream": True})
    ends, last = choice_endings(chunks)
    assert {i: len(e) for i, e in ends.items()} == {0: 1, 1: 1}
    assert all(ends[i][0] == last[i] for i in ends)  # nothing of a choice after its end
    for choice in plain["choices"]:
        parts = [ch for c in chunks for ch in c["choices"] if ch["index"] == choice["index"]]
        assert "".join(p["text"] for p in parts) == choice["text"]
        assert sum((p["logprobs"]["tokens"] for p in parts if p["logprobs"]), []) == choice["logprobs"]["tokens"]
        assert parts[-1]["finish_reason"] == choice["finish_reason"]


def test_streamed_chat_choices_end_exactly_once(client):
    base = {"model": "tiny", "messages": [{"role": "user", "content": "Tell a story"}], "max_tokens": 20,
            "seed": 7, "n": 3}
    plain = client.post("/v1/chat/completions", json=base).json()
    stop = stop_ending_only([c["message"]["content"] for c in plain["choices"]])
    body = {**base, "stop": stop}
    plain = client.post("/v1/chat/completions", json=body).json()
    chunks = events(client, "/v1/chat/completions", {**body, "stream": True})
    ends, last = choice_endings(chunks)
    assert {i: len(e) for i, e in ends.items()} == {0: 1, 1: 1, 2: 1}
    assert all(ends[i][0] == last[i] for i in ends)
    for choice in plain["choices"]:
        parts = [ch for c in chunks for ch in c["choices"] if ch["index"] == choice["index"]]
        assert "".join(p["delta"].get("content", "") for p in parts) == choice["message"]["content"]
        assert parts[-1]["finish_reason"] == choice["finish_reason"]


# ---- differences from vLLM ------------------------------------------------------------------------

def test_chat_prompt_logprobs_is_null_when_not_asked(fake_client):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    out = fake_client.post("/v1/chat/completions", json=body).json()
    assert "prompt_logprobs" in out and out["prompt_logprobs"] is None
    asked = fake_client.post("/v1/chat/completions", json={**body, "prompt_logprobs": 1}).json()
    assert isinstance(asked["prompt_logprobs"], list) and asked["prompt_logprobs"][0] is None


@pytest.mark.parametrize("seed,ok", [(-2**63, True), (-2**63 - 1, False), (-2**63 - 1025, False),
                                     (2**63 - 1, True), (2**63, False), (2**64, False)])
def test_seed_bounds_are_checked_on_the_integer(fake_client, seed, ok):
    raw = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1, "seed": seed}).encode()
    r = fake_client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    if ok:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "seed"
    bound = "greater than or equal to -9223372036854775808" if seed < 0 else \
        "less than or equal to 9223372036854775807"
    assert err["message"] == f"Invalid value for 'seed': expected a value {bound}."


def test_echo_of_token_ids_spells_special_tokens(fake_client, fake_backend):
    """vLLM echoes a token-id prompt decoded with its special tokens: the tokens spell the text."""
    body = {"model": "tiny", "prompt": [0, 0, 0, 0, 0], "echo": True, "logprobs": 1, "max_tokens": 3,
            "temperature": 0}
    choice = fake_client.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    eot = fake_backend.tokenizer.convert_ids_to_tokens(0)
    assert choice["text"].startswith(eot * 5)
    assert lp["tokens"][:5] == [eot] * 5
    assert lp["text_offset"][:5] == [0, len(eot), 2 * len(eot), 3 * len(eot), 4 * len(eot)]
    assert "".join(lp["tokens"]) == choice["text"]  # every token of this model is whole UTF-8 here
    text = choice["text"]
    for i, (tok, off) in enumerate(zip(lp["tokens"], lp["text_offset"])):
        end = lp["text_offset"][i + 1] if i + 1 < len(lp["tokens"]) else len(text)
        assert text[off:end] == tok
    decoded = fake_backend.tokenizer.decode([0] * 5)  # what vLLM echoes
    assert text.startswith(decoded)


def test_echo_of_token_ids_gives_a_leading_bos_no_text(fake_client, fake_backend):
    """The contract's echo: "no BOS text", also for a token-id prompt (where it and vLLM differ), for the
    BOS that begins the prompt; a BOS id later in it is a token of the text and spells its text."""
    bos = fake_backend.info.bos_token_id
    bos_text = fake_backend.tokenizer.bos_token
    eot = fake_backend.tokenizer.convert_ids_to_tokens(0)
    body = {"model": "tiny", "prompt": [bos, 0, bos, 0], "echo": True, "logprobs": 0, "max_tokens": 0}
    choice = fake_client.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == eot + bos_text + eot
    assert lp["tokens"] == [bos_text, eot, bos_text, eot]
    assert lp["text_offset"] == [0, 0, len(eot), len(eot) + len(bos_text)]


def test_echo_of_text_prompt_is_the_text_as_sent(fake_client, fake_backend):
    eot = fake_backend.tokenizer.convert_ids_to_tokens(0)
    prompt = eot + "The sky"
    body = {"model": "tiny", "prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 2}
    choice = fake_client.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"].startswith(prompt)
    lp = choice["logprobs"]
    assert lp["tokens"][0] == eot and lp["text_offset"][:2] == [0, len(eot)]


# ---- small messages -------------------------------------------------------------------------------

def test_unimplemented_fields_name_their_json_value(fake_client):
    r = fake_client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "suffix": "tail"})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "send null" in msg and "None" not in msg
    r = fake_client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                  "tool_choice": "auto"})
    assert 'send "none"' in r.json()["error"]["message"]


@pytest.mark.parametrize("path,field", [("/v1/completions", "max_tokens"), ("/v1/chat/completions", "max_tokens"),
                                        ("/v1/chat/completions", "max_completion_tokens")])
def test_huge_max_tokens_names_the_context(fake_client, fake_backend, path, field):
    body = {"model": "tiny", field: 1e20}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    err = fake_client.post(path, json=body).json()["error"]
    ctx = fake_backend.info.context_length
    assert err["message"].startswith(f"This model's maximum context length is {ctx} tokens.")
    assert "9223372036854775807" not in err["message"] and err["param"] == field


def test_health_probes_while_loading_are_not_logged(caplog):
    app = create_app(None)
    with TestClient(app, raise_server_exceptions=False) as c, caplog.at_level(logging.INFO, logger="logprobe.access"):
        for _ in range(5):
            assert c.get("/health").status_code == 503
        c.post("/v1/completions", json={"model": "tiny", "prompt": "x"})  # a refused API call is logged
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "logprobe.access"]
    assert [x["path"] for x in lines] == ["/v1/completions"] and lines[0]["status"] == 503


# ---- the client's dense reader --------------------------------------------------------------------

@pytest.mark.parametrize("encoding", ["float32", "float16"])
def test_dense_reader_reads_the_width_from_the_answer(fake_client, fake_backend, encoding):
    body = {"model": "tiny", "prompt": "Dense rows here", "max_tokens": 0, "prompt_logprobs": -1,
            "vocab_encoding": encoding}
    entries = fake_client.post("/v1/completions", json=body).json()["choices"][0]["prompt_logprobs"]
    full = fake_client.post("/v1/completions",
                            json={**body, "vocab_encoding": None}).json()["choices"][0]["prompt_logprobs"]
    vocab = fake_backend.info.vocab_size
    for enc in (None, encoding):
        dense = dense_prompt_logprobs(entries, enc)
        assert dense.shape == (len(entries), vocab) and np.isnan(dense[0]).all()
        for pos in range(1, len(entries)):  # the JSON form's numbers, to the encoding's precision
            want = np.array([full[pos][str(i)]["logprob"] for i in range(vocab)])
            np.testing.assert_allclose(dense[pos], want, rtol=1e-3 if encoding == "float16" else 0, atol=1e-6)
    other = "float32" if encoding == "float16" else "float16"
    with pytest.raises(ValueError, match="do not read as"):
        dense_prompt_logprobs(entries, other)


def test_dense_reader_refuses_what_it_cannot_read():
    raw = base64.b64encode(np.arange(7, dtype="<f2").tobytes()).decode()  # 14 bytes: float16 only
    with pytest.raises(ValueError):
        dense_prompt_logprobs([None, {"token_id": 3, "logprob": -1.0, "rank": 1, "logprobs": raw}])
    with pytest.raises(ValueError, match="not a dense entry"):
        dense_prompt_logprobs([None, {"token_id": 3, "logprob": -1.0, "rank": 1, "top_logprobs": {}}])
    ok = [None, {"token_id": 3, "logprob": 3.0, "rank": 1, "logprobs": raw}]
    assert dense_prompt_logprobs(ok).shape == (2, 7)


MESSAGES = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_and_ignore_eos_reach_the_engine(fake_client, fake_backend, path, stream):
    """vLLM's fields (its benchmark tools send `ignore_eos`); left out, the request's parameters are the
    plain defaults."""
    body = {"model": "tiny", "max_tokens": 5, "stream": stream,
            **({"prompt": "x"} if path == "/v1/completions" else {"messages": MESSAGES})}
    assert fake_client.post(path, json={**body, "min_tokens": 3, "ignore_eos": True}).status_code == 200
    params = fake_backend.requests[-1].params
    assert (params.min_tokens, params.ignore_eos, params.max_tokens) == (3, True, 5)
    assert fake_client.post(path, json={**body, "min_tokens": None, "ignore_eos": None}).status_code == 200
    assert (fake_backend.requests[-1].params.min_tokens, fake_backend.requests[-1].params.ignore_eos) == (0, False)


@pytest.mark.parametrize("path, body, message", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 3},
     "Invalid value for 'min_tokens': 3 is more than 'max_tokens' (2); 'min_tokens' must be at most 'max_tokens'."),
    ("/v1/completions", {"prompt": "x", "min_tokens": 17}, "17 is more than 'max_tokens' (16)"),  # the default
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 1, "min_tokens": 2},
     "2 is more than 'max_completion_tokens' (1)"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "min_tokens": 2}, "2 is more than 'max_tokens' (1)"),
    ("/v1/chat/completions", {"messages": MESSAGES, "min_tokens": 10_000},
     "tokens the context leaves after the messages (the default 'max_completion_tokens')"),
    ("/v1/completions", {"prompt": "x", "min_tokens": -1}, "'min_tokens'"),
    ("/v1/completions", {"prompt": "x", "ignore_eos": "yes"}, "'ignore_eos'"),
])
def test_min_tokens_and_ignore_eos_refusals(fake_client, path, body, message):
    r = fake_client.post(path, json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_request" and err["param"] == next(k for k in ("min_tokens", "ignore_eos") if k in body)
    assert message in err["message"], err["message"]


def test_min_tokens_and_ignore_eos_are_in_the_openapi_schema(fake_client):
    schemas = fake_client.get("/openapi.json").json()["components"]["schemas"]
    for name in ("CompletionBody", "ChatBody"):
        props = schemas[name]["properties"]
        assert props["min_tokens"]["default"] == 0 and props["ignore_eos"]["default"] is False


@pytest.mark.parametrize("stream", [False, True])
def test_special_tokens_write_no_text_unless_asked(client, tokenizer, stream):
    """`skip_special_tokens` (vLLM's, default true): every token the tokenizer marks special (SmolLM2's
    `<repo_name>`, id 3, is an added token marked special, not one of its named ones) adds no text, as
    transformers' decode(skip_special_tokens=True); false adds its text, but never that of the stop token
    that ends the choice. The tokens and their log probabilities are the same either way. On the tiny
    engine (`allowed_token_ids` picks the token: the fake backend draws without masks)."""
    repo = tokenizer.convert_tokens_to_ids("<repo_name>")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert repo not in tokenizer.all_special_ids and tokenizer.added_tokens_decoder[repo].special
    assert tokenizer.decode([repo], skip_special_tokens=True) == ""

    def text_of(**fields):
        body = {"model": "tiny", "prompt": "x", "max_tokens": 3, "temperature": 0, "logprobs": 1, **fields}
        if not stream:
            choice = client.post("/v1/completions", json=body).json()["choices"][0]
            return choice["text"], choice["logprobs"]["tokens"], choice["finish_reason"]
        text, tokens, finish = "", [], None
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    tokens += (choice.get("logprobs") or {}).get("tokens", [])
                    finish = choice.get("finish_reason") or finish
        return text, tokens, finish

    assert text_of(allowed_token_ids=[repo]) == ("", ["<repo_name>"] * 3, "length")
    assert text_of(allowed_token_ids=[repo], skip_special_tokens=None) == ("", ["<repo_name>"] * 3, "length")
    assert text_of(allowed_token_ids=[repo], skip_special_tokens=False) == ("<repo_name>" * 3, ["<repo_name>"] * 3,
                                                                            "length")
    # the stop token that ends the choice: no text either way; run past it (ignore_eos), it is a token of the text
    assert text_of(allowed_token_ids=[end], skip_special_tokens=False) == ("", ["<|im_end|>"], "stop")
    assert text_of(allowed_token_ids=[end], skip_special_tokens=False, ignore_eos=True) == (
        "<|im_end|>" * 3, ["<|im_end|>"] * 3, "length")
    assert text_of(allowed_token_ids=[end], ignore_eos=True) == ("", ["<|im_end|>"] * 3, "length")
    chat = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": MESSAGES, "max_tokens": 2, "temperature": 0, "allowed_token_ids": [repo],
        "skip_special_tokens": False}).json()
    assert chat["choices"][0]["message"]["content"] == "<repo_name>" * 2


def test_a_token_id_prompt_echoes_every_bos_after_the_first(fake_client, tokenizer):
    """SmolLM2's GGUF declares `<|im_start|>` (every chat turn's opening) its BOS: a rendered conversation
    sent as token ids echoes each turn's `<|im_start|>` but the leading one (the contract: no BOS text),
    and the echoed tokens, joined, are the echoed text."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}],
                                         tokenize=False)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    bos = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == bos and ids.count(bos) >= 2  # the template's default system turn, the user's, the reply's
    choice = fake_client.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 0, "echo": True,
                                                       "logprobs": 0}).json()["choices"][0]
    assert choice["text"] == text[len("<|im_start|>"):]
    tokens, offsets = choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
    assert "".join(tokens[1:]) == choice["text"] and offsets[0] == offsets[1] == 0
    assert all(choice["text"][o:].startswith(t) for o, t in zip(offsets[1:], tokens[1:]))
