"""/v1/score on a conversation (`messages`, `score_messages`, `replies`) and with one list of asked ids per
position (`logprob_token_ids`), against the float64 reference and /v1/completions with `echo` on the
rendered conversation; several replies to one conversation run the conversation through the blocks once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

TOL = 1e-5
CONVERSATION = [{"role": "system", "content": "You answer in one short sentence."},
                {"role": "user", "content": "Where do dolphins live?"},
                {"role": "assistant", "content": "Dolphins live in the sea."},
                {"role": "user", "content": "And do they breathe air?"},
                {"role": "assistant", "content": "Yes, they breathe air through a blowhole."}]


def post(client, path, **body):
    body.setdefault("model", "tiny")
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def rendered_ids(tokenizer, messages):
    """The conversation as /v1/chat/completions tokenizes it, written here from the tokenizer alone."""
    return tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False).input_ids


def reply_span(tokenizer, messages, index):
    """Token positions of messages[index]'s content and the end-of-turn token after it: the conversation
    before it with the generation prompt is a prefix of the rendering, the content's tokens follow."""
    before = tokenizer(tokenizer.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False).input_ids
    content = tokenizer(messages[index]["content"], add_special_tokens=False).input_ids
    full = rendered_ids(tokenizer, messages)
    assert full[:len(before)] == before and full[len(before):len(before) + len(content)] == content
    assert tokenizer.convert_ids_to_tokens(full[len(before) + len(content)]) == "<|im_end|>"
    return len(before), len(before) + len(content) + 1


def test_last_reply_equals_echo_and_reference(client, reference, tokenizer):
    out = post(client, "/v1/score", messages=CONVERSATION, top_logprobs=2)
    (entry,) = out["data"]
    first, stop = reply_span(tokenizer, CONVERSATION, 4)
    full = rendered_ids(tokenizer, CONVERSATION)
    assert entry["message_index"] == 4 and entry["token_ids"] == full[first:stop]
    assert entry["num_tokens"] == stop - first
    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    for prompt in (text, full):  # the rendered text, and its tokens
        echo = post(client, "/v1/completions", prompt=prompt, max_tokens=0, echo=True, logprobs=2)["choices"][0]
        echo = echo["logprobs"]
        assert len(echo["tokens"]) == len(full)  # the text gets no BOS: SmolLM2's tokenizer adds none
        # the same engine path; within float32 rounding where one of them found the other's blocks cached
        np.testing.assert_allclose(entry["token_logprobs"], echo["token_logprobs"][first:stop], atol=TOL)
        assert entry["tokens"] == echo["tokens"][first:stop]
    ref = reference.logprobs(full).numpy()
    want = ref[np.arange(first - 1, stop - 1), full[first:stop]]
    np.testing.assert_allclose(entry["token_logprobs"], want, atol=TOL)
    assert abs(entry["logprob"] - want.sum()) < 1e-4
    for rank, row, token in zip(entry["token_ranks"], ref[first - 1:stop - 1], full[first:stop]):
        low, high = reference.rank_bounds(torch.from_numpy(row), token)
        assert low <= rank <= high
    assert entry["tokens"][-1] == "<|im_end|>"
    without = post(client, "/v1/score", messages=CONVERSATION, include_end_of_turn=False)["data"][0]
    assert without["token_logprobs"] == entry["token_logprobs"][:-1]


def test_named_turns_each_an_entry(client, reference, tokenizer):
    out = post(client, "/v1/score", messages=CONVERSATION, score_messages=[2, 4], position_stats=True)
    full = rendered_ids(tokenizer, CONVERSATION)
    ref = reference.logprobs(full)
    for entry, index in zip(out["data"], (2, 4)):
        first, stop = reply_span(tokenizer, CONVERSATION, index)
        assert entry["message_index"] == index and entry["token_ids"] == full[first:stop]
        rows = ref[first - 1:stop - 1]
        np.testing.assert_allclose(entry["token_logprobs"], rows.numpy()[np.arange(stop - first), full[first:stop]],
                                   atol=TOL)
        np.testing.assert_allclose(entry["position_stats"]["entropy"], -(rows.exp() * rows).sum(-1).numpy(), atol=1e-4)


def test_replies_share_the_conversation_pass(client, tiny_engine, reference, tokenizer):
    """Three replies: the conversation before them runs through the blocks once (its own pass), then each
    reply's own tokens in one pass beside the others; every number is the reference's."""
    question = [{"role": "user", "content": "Name an animal that lives in the sea but breathes air, please."}]
    replies = ["A dolphin.", "The whale, which surfaces to breathe.", "Cows."]
    runner = tiny_engine.runner
    seen = []
    forward = runner._embed  # every pass of the blocks begins here (`forward`, `forward_steps`)
    runner._embed = lambda ids, *a, **k: seen.append(tuple(ids.shape)) or forward(ids, *a, **k)
    try:
        out = post(client, "/v1/score", messages=question, replies=replies)
    finally:
        del runner._embed
    convs = [question + [{"role": "assistant", "content": r}] for r in replies]
    spans = [reply_span(tokenizer, c, 1) for c in convs]
    prefix = spans[0][0]  # the conversation and the assistant's opening
    own = [stop - prefix for _, stop in spans]
    through = sum(b * t for b, t in seen)
    assert seen == [(1, prefix), (3, max(own))], seen  # the conversation once, then the replies together
    assert through == prefix + 3 * max(own) < 3 * prefix
    for entry, conv, (first, stop) in zip(out["data"], convs, spans):
        full = rendered_ids(tokenizer, conv)
        ref = reference.logprobs(full[:stop]).numpy()
        np.testing.assert_allclose(entry["token_logprobs"], ref[np.arange(first - 1, stop - 1), full[first:stop]],
                                   atol=TOL)
        assert entry["message_index"] == 1


def test_a_template_that_merges_tokens_is_refused(client):
    """SmolLM2's template writes "assistant\\n" before the reply: a reply that begins with a newline makes
    one token of both newlines, which is not the reply's alone."""
    r = client.post("/v1/score", json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                                        "replies": ["\n\nHello"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "start of messages[1]" in r.json()["error"]["message"]


def asked_lists(rng, num, vocab):
    """Per position 0 to 40 ids (more than instruments.FEW_IDS ranks by sorting), the tied tokens among them."""
    out = []
    for _ in range(num):
        ids = rng.integers(0, vocab, rng.integers(0, 40)).tolist()
        out.append(ids + [100, 101] if len(out) % 3 == 0 else ids)
    return out


def check_block(block, asked, rows, reference):
    """An entry's per-position block against reference rows [N, V] (row j predicts scored token j)."""
    assert block["token_ids"] == asked
    for ids, values, ranks, row in zip(asked, block["logprobs"], block["ranks"], rows):
        np.testing.assert_allclose(values, row[ids].numpy() if ids else [], atol=TOL)
        for token, rank in zip(ids, ranks):
            low, high = reference.rank_bounds(row, token)
            assert low <= rank <= high


def test_per_position_ids_against_reference(client, tiny_engine, reference, tokenizer):
    rng = np.random.default_rng(0)
    vocab, bos = tiny_engine.info.vocab_size, tiny_engine.info.bos_token_id
    texts = ["The quick brown fox jumps over the lazy dog.", "A second text, a little longer than the first one."]
    ids = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    asked = [asked_lists(rng, len(x), vocab) for x in ids]
    out = post(client, "/v1/score", input=texts, logprob_token_ids=asked)
    for entry, x, mine in zip(out["data"], ids, asked):
        check_block(entry["logprob_token_ids"], mine, reference.logprobs([bos] + x)[:-1], reference)
    one = post(client, "/v1/score", input=texts[0], logprob_token_ids=asked[0])["data"][0]  # one entry: [[...]]
    mine = out["data"][0]["logprob_token_ids"]  # the same lists, alone (float32 sums in another order: close)
    assert one["logprob_token_ids"]["token_ids"] == mine["token_ids"]
    for a, b in zip(one["logprob_token_ids"]["logprobs"], mine["logprobs"]):
        np.testing.assert_allclose(a, b, atol=TOL)
    same = post(client, "/v1/score", input=texts[0], logprob_token_ids=[5, 100, 101])["data"][0]["logprob_token_ids"]
    check_block({**same, "token_ids": [[5, 100, 101]] * len(ids[0])}, [[5, 100, 101]] * len(ids[0]),
                reference.logprobs([bos] + ids[0])[:-1], reference)
    assert same["token_ids"] == [5, 100, 101]
    # a reply's positions: the lists follow its scored tokens, end-of-turn included
    first, stop = reply_span(tokenizer, CONVERSATION, 4)
    mine = asked_lists(rng, stop - first, vocab)
    entry = post(client, "/v1/score", messages=CONVERSATION, logprob_token_ids=mine)["data"][0]
    full = rendered_ids(tokenizer, CONVERSATION)
    check_block(entry["logprob_token_ids"], mine, reference.logprobs(full)[first - 1:stop - 1], reference)


@pytest.mark.parametrize("body, param, words", [
    ({"input": "a b c", "logprob_token_ids": [[1], [2]]}, "logprob_token_ids",
     "one list of ids per token of the entry's 'tokens'"),
    ({"input": ["a", "b"], "logprob_token_ids": [[1]]}, "logprob_token_ids", "one list of positions per entry"),
    ({"input": "a", "logprob_token_ids": [[10**6]]}, "logprob_token_ids", "outside the vocabulary"),
    ({"messages": [{"role": "user", "content": "Hi"}]}, "messages", "no assistant message"),
    ({"messages": CONVERSATION, "score_messages": [1]}, "score_messages", "not an assistant turn"),
])
def test_refusals_that_need_the_model(client, body, param, words):
    r = client.post("/v1/score", json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize("fast", [True, False])
def test_per_position_ids_on_both_runners(fast, tiny_model, tokenizer, reference):
    """Prompt-only groups with their own ids at each position, on the lean runner (two of them sharing a
    context's pass, the third alone) and on transformers' forward, against the reference."""
    from logprobe.engine.engine import Engine
    from logprobe.engine.host.request import SamplingParams, SequenceGroup

    engine = Engine(tiny_model, tokenizer, "m", [], fast=fast)
    rng = np.random.default_rng(1)
    ctx = tokenizer("Question: which of these animals lives in the sea and breathes air? Answer:").input_ids
    prompts = [ctx + tokenizer(a, add_special_tokens=False).input_ids for a in (" the dolphin", " a cow")]
    prompts.append(tokenizer("Nothing in common with the others").input_ids)
    asked = [tuple(tuple(x) for x in [[]] + asked_lists(rng, len(p) - 1, len(tokenizer))) for p in prompts]
    groups = [SequenceGroup(f"s{i}", p, SamplingParams(max_tokens=0, echo=True, logprobs=0, position_token_ids=a),
                            engine.table) for i, (p, a) in enumerate(zip(prompts, asked))]
    with torch.inference_mode():
        engine.runner.prefill_batch(groups)
    for group, ids, mine in zip(groups, prompts, asked):
        extras = engine.runner.prompt_columns(group).extras
        rows = reference.logprobs(ids)[:-1]
        for position, (want, row) in enumerate(zip(mine[1:], rows), start=1):
            np.testing.assert_allclose(extras.token_id_logprobs[position, :len(want)], row[list(want)].numpy(),
                                       atol=TOL)
            for token, rank in zip(want, extras.token_id_ranks[position, :len(want)]):
                low, high = reference.rank_bounds(row, token)
                assert low <= rank <= high
