"""`usage.prompt_tokens_details.cached_tokens` (completions, chat, streamed or not) and the Responses API's
`usage.input_tokens_details.cached_tokens`: the prompt tokens the prefix cache held, so no pass of the
blocks computed them. Checked against the prefix cache's own count of the tokens it spared
(`prefix_cache_tokens_saved` in the engine's stats), request by request, and against the tokens the
passes actually ran; a first request of a text reports 0."""

from __future__ import annotations

import json
import secrets

import numpy as np

from logprobe.engine.runners.prefix_cache import BLOCK

MODEL = "tiny"


def unique_text(words: int = 60) -> str:
    """A text no other test sends (the engine is the session's): random words."""
    gen = np.random.default_rng(int.from_bytes(secrets.token_bytes(8), "little"))
    vocab = ["river", "stone", "quiet", "lamp", "orbit", "seven", "market", "window", "letter", "garden",
             "copper", "winter", "signal", "paper", "bridge", "violet"]
    return " ".join(vocab[i] for i in gen.integers(0, len(vocab), words))


def saved(engine) -> int:
    return engine.stats()["prefix_cache_tokens_saved"]


def sent(client, engine, path: str, body: dict) -> tuple[dict, int]:
    """The answer to `body` (its usage: the last chunk's when streamed) and the tokens the prefix cache
    says it spared while serving it."""
    before = saved(engine)
    r = client.post(path, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    if body.get("stream"):
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        usage = next(e["response"]["usage"] for e in events if e.get("type") in ("response.completed", "response.incomplete")) \
            if path == "/v1/responses" else events[-1]["usage"]
    else:
        usage = r.json()["usage"]
    return usage, saved(engine) - before


def test_completions_report_the_prompt_tokens_the_cache_held(client, tiny_engine):
    prompt = unique_text()
    first, spared = sent(client, tiny_engine, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert first["prompt_tokens_details"] == {"cached_tokens": 0} and spared == 0
    second, spared = sent(client, tiny_engine, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached == spared >= BLOCK and cached < second["prompt_tokens"] == first["prompt_tokens"]
    assert second["total_tokens"] == second["prompt_tokens"] + second["completion_tokens"]
    # streamed: the usage chunk carries it too
    streamed, spared = sent(client, tiny_engine, "/v1/completions", {
        "prompt": prompt, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}})
    assert streamed["prompt_tokens_details"]["cached_tokens"] == spared >= cached
    # a prompt-only request (echo, max_tokens 0) runs in the scoring pass: its kept prefix counts alike
    scored, spared = sent(client, tiny_engine, "/v1/completions", {"prompt": prompt + " river", "max_tokens": 0,
                                                                   "echo": True, "logprobs": 1})
    assert scored["prompt_tokens_details"]["cached_tokens"] == spared >= BLOCK


def test_several_prompts_add_up(client, tiny_engine):
    a, b = unique_text(), unique_text()
    sent(client, tiny_engine, "/v1/completions", {"prompt": a, "max_tokens": 1})
    usage, spared = sent(client, tiny_engine, "/v1/completions", {"prompt": [a, b], "max_tokens": 1})
    assert usage["prompt_tokens_details"]["cached_tokens"] == spared >= BLOCK  # a's, and none of b's


def spared_first(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_chat_and_responses_report_it(client, tiny_engine):
    messages = [{"role": "user", "content": unique_text()}]
    # a first request may find the template's first tokens, kept by other chats
    first, spared = sent(client, tiny_engine, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert first["prompt_tokens_details"]["cached_tokens"] == spared
    again, spared = sent(client, tiny_engine, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert again["prompt_tokens_details"]["cached_tokens"] == spared >= spared_first(first) + BLOCK
    streamed, spared = sent(client, tiny_engine, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}})
    assert streamed["prompt_tokens_details"]["cached_tokens"] == spared >= BLOCK

    text = unique_text()
    first, spared = sent(client, tiny_engine, "/v1/responses", {"input": text, "max_output_tokens": 2})
    assert first["input_tokens_details"]["cached_tokens"] == spared
    again, spared = sent(client, tiny_engine, "/v1/responses", {"input": text, "max_output_tokens": 2})
    assert again["input_tokens_details"]["cached_tokens"] == spared >= first["input_tokens_details"]["cached_tokens"] + BLOCK
    assert again["input_tokens"] == first["input_tokens"]
    streamed, spared = sent(client, tiny_engine, "/v1/responses", {"input": text, "max_output_tokens": 2,
                                                                   "stream": True})
    assert streamed["input_tokens_details"]["cached_tokens"] == spared >= BLOCK
