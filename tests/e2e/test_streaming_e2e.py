"""Streaming and chat on the bundled model through the openai SDK; the seed 003 program as written;
a client that disconnects mid-stream (and mid-request) frees its place at once."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m"
ROOT = Path(__file__).resolve().parents[2]
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # greedy decoding keeps counting for hundreds of tokens


def test_sdk_completion_stream_equals_plain(oai):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, logprobs=3, seed=21, n=2)
    plain = oai.completions.create(**kw)
    texts, tokens, lps = {}, {}, {}
    for chunk in oai.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            tokens.setdefault(ch.index, []).extend(ch.logprobs.tokens)
            lps.setdefault(ch.index, []).extend(ch.logprobs.token_logprobs)
    for choice in plain.choices:
        assert texts[choice.index] == choice.text
        assert tokens[choice.index] == choice.logprobs.tokens
        np.testing.assert_allclose(lps[choice.index], choice.logprobs.token_logprobs, atol=1e-5)


def test_sdk_chat_stream_with_logprobs(oai):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12, temperature=0,
              logprobs=True, top_logprobs=3)
    plain = oai.chat.completions.create(**kw)
    content, entries, usage = "", [], None
    for chunk in oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            content += ch.delta.content or ""
            if ch.logprobs and ch.logprobs.content:
                entries += ch.logprobs.content
    assert content == plain.choices[0].message.content
    assert [e.token for e in entries] == [e.token for e in plain.choices[0].logprobs.content]
    assert all(len(e.top_logprobs) == 3 for e in entries)
    assert usage.completion_tokens == plain.usage.completion_tokens


def test_sdk_responses_with_logprobs_streamed_and_not(oai, smol_dir, ref64):
    """The Responses API on the bundled model: the reply's log probabilities are float64's at the
    templated conversation's positions, equal chat's, and the stream's deltas carry the same."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    kw = dict(model=MODEL, instructions="Be brief.", input="Say hello.", max_output_tokens=6, temperature=0,
              include=["message.output_text.logprobs"], top_logprobs=3)
    plain = oai.responses.create(**kw)
    entries = plain.output[0].content[0].logprobs
    chat = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"return_tokens_as_token_ids": True})
    gen = [int(e.token.split(":")[1]) for e in chat.choices[0].logprobs.content]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smol_dir))
    prompt = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False).input_ids
    assert plain.usage.input_tokens == len(prompt) and len(entries) == len(gen) > 0
    ref = ref64(prompt + gen)
    for i, (entry, token) in enumerate(zip(entries, gen)):
        row = ref[len(prompt) - 1 + i]
        assert token == int(np.argmax(row)) and abs(entry.logprob - row[token]) < 2e-4
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
    events = list(oai.responses.create(**kw, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(d.delta for d in deltas) == plain.output_text
    assert [x.token for d in deltas for x in d.logprobs] == [e.token for e in entries]
    np.testing.assert_allclose([x.logprob for d in deltas for x in d.logprobs], [e.logprob for e in entries],
                               atol=1e-5)
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.usage.output_tokens == plain.usage.output_tokens


def test_seed_003_program_as_written(server, ref64):
    # The program keeps the SDK's defaults (two retries); its log shows a retry, which must not happen.
    env = {**os.environ, "OPENAI_BASE_URL": server + "/v1", "OPENAI_API_KEY": "none", "OPENAI_LOG": "info"}
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "seed003_top_logprobs.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert "Retrying request" not in run.stderr, run.stderr
    out = run.stdout
    assert out.startswith("Top token probabilities:")
    rows = re.findall(r"^  (.*) → (-?\d+\.\d{3})$", out, flags=re.M)
    assert len(rows) == 5
    # the five printed alternatives are the model's five likeliest first tokens of the reply
    ids = httpx.post(server + "/tokenize", json={"prompt": (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nA common fruit people eat is<|im_end|>\n<|im_start|>assistant\n"),
        "add_special_tokens": False}, timeout=600).json()["tokens"]
    row = ref64(ids)[-1]
    top = np.sort(row)[::-1][:5]
    np.testing.assert_allclose([float(v) for _, v in rows], top, atol=1.5e-3)


def wait_idle(server, timeout=120.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        health = httpx.get(server + "/health", timeout=600).json()
        if health["in_flight"] == 0:
            return health
        time.sleep(0.05)
    raise AssertionError(f"still in flight: {health}")


def test_disconnect_mid_stream_frees_the_engine(server):
    before = wait_idle(server)["engine_steps"]
    body = {"model": MODEL, "prompt": COUNTING, "max_tokens": 3000, "stream": True, "temperature": 0}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=600) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 10:
                break
    idle = wait_idle(server)
    used = idle["engine_steps"] - before
    assert used < 40, used  # it stopped within a step or two of the disconnect, not after 3000
    time.sleep(0.3)
    # nothing left running
    assert httpx.get(server + "/health", timeout=600).json()["engine_steps"] == idle["engine_steps"]
    # the next request has the engine to itself: exactly its own 20 steps (1 prefill + 19 decodes)
    out = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "Next", "max_tokens": 20,
                                                       "temperature": 0}, timeout=600).json()
    assert out["usage"]["completion_tokens"] == 20
    assert httpx.get(server + "/health", timeout=600).json()["engine_steps"] == idle["engine_steps"] + 20


def test_disconnect_before_a_plain_answer_aborts_it(server):
    before = wait_idle(server)["engine_steps"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": COUNTING, "max_tokens": 3000,
                                                     "temperature": 0}, timeout=1.0)
    idle = wait_idle(server)
    assert idle["engine_steps"] - before < 300  # aborted at the disconnect, not run to 3000 tokens
