"""A batch on the engine, through the openai SDK, on every endpoint: each line's answer is the answer
of its body sent alone, every number the same bits though a line shares its passes and cached prefixes
with others (within 1e-5 on torch older than 2.13), and the scores are the float64 reference's."""

from __future__ import annotations

import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from batch_helpers import assert_same_answer, jsonl, lines_of, request_line, sdk, wait_for, without_ids
from logprobe.server import attach_backends, create_app
from logprobe.config import BatchSettings, Limits
from logprobe.engine.engine import Engine
from logprobe.engine.runners.lean.attention import Attention

TOL = 1e-5
SAME = 0.0 if Attention.invariant_kernels() else TOL  # a line and its body alone: the same bits (torch >= 2.13)
TEXTS = ["The cat sat on the mat.", "A", "Colorless green ideas sleep furiously, said the linguist.", "1 2 3 4 5"]


@pytest.fixture(scope="module")
def served(tiny_model, tiny_model_factory, tokenizer, reference_of, tmp_path_factory):
    other = Engine(tiny_model_factory(len(tokenizer), seed=3), tokenizer, "test/tiny-llama-b", ["tiny-b"])
    mine = Engine(tiny_model, tokenizer, "test/tiny-llama", ["tiny"])
    mine.start()
    other.start()
    app = create_app(None, Limits(), batch=BatchSettings(data_dir=str(tmp_path_factory.mktemp("batches"))))
    attach_backends(app, [mine, other])
    with TestClient(app) as client:
        yield client, mine, reference_of(tiny_model)
    mine.stop()
    other.stop()


BODIES = {
    "/v1/score": [{"model": "tiny", "input": t, "top_logprobs": 2} for t in TEXTS]
    + [{"model": "tiny", "input": [" mat", " rug"], "context": "The cat sat on the"},
       {"model": "tiny", "input": "the mat", "context": "The cat sat on", "output_residual_stream": [1]},
       {"model": "tiny", "input": [40, 41, 42], "add_bos": False, "return_tokens_as_token_ids": True},
       {"model": "tiny", "messages": [{"role": "user", "content": "Say hello."}], "replies": ["Hello!", "Hi."]},
       {"model": "tiny", "input": [40, 41, 42], "logprob_token_ids": [[5, 6], [], [7, 100, 101]]}],
    "/v1/completions": [{"model": "tiny", "prompt": t, "max_tokens": 3, "temperature": 0, "logprobs": 2,
                         "echo": True} for t in TEXTS]
    + [{"model": "tiny", "prompt": "Hello there", "max_tokens": 4, "seed": 7, "n": 2, "logprobs": 1,
        "prompt_logprobs": 2},
       {"model": "tiny", "prompt": "Is it? Answer:", "max_tokens": 4, "seed": 3, "n": 3, "logprobs": 1,
        "structured_outputs": {"choice": [" yes", " no", "maybe so"]}}],
    "/v1/chat/completions": [{"model": "tiny", "messages": [{"role": "user", "content": t}], "max_tokens": 3,
                              "temperature": 0, "logprobs": True, "top_logprobs": 2} for t in TEXTS]
    + [{"model": "tiny", "messages": [{"role": "user", "content": "Is it?"}], "max_tokens": 4, "temperature": 0,
        "structured_outputs": {"choice": [" yes", " no"]}}],
    "/v1/compare": [{"models": ["tiny", "tiny-b"], "input": t} for t in TEXTS]
    + [{"models": ["tiny", "tiny-b"], "input": t, "align": "text"} for t in TEXTS[:3]],
    "/v1/responses": [{"model": "tiny", "input": t, "instructions": "Be brief.", "max_output_tokens": 3,
                       "temperature": 0, "include": ["message.output_text.logprobs"], "top_logprobs": 2}
                      for t in TEXTS],
}


@pytest.mark.parametrize("endpoint", list(BODIES))
def test_every_line_is_its_body_answered_alone(served, endpoint):
    client, engine, reference = served
    oai = sdk(client)
    lines = [request_line(f"{endpoint}-{i}", endpoint, body) for i, body in enumerate(BODIES[endpoint])]
    uploaded = oai.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = oai.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")
    done = wait_for(oai, batch.id)
    assert done.status == "completed" and done.request_counts.completed == len(lines), done
    output = {x["custom_id"]: x for x in lines_of(oai, done.output_file_id)}
    assert sorted(output) == sorted(x["custom_id"] for x in lines)
    for line in lines:
        got = output[line["custom_id"]]["response"]
        alone = client.post(endpoint, json=line["body"])
        assert got["status_code"] == alone.status_code == 200, alone.text
        assert_same_answer(without_ids(got["body"]), without_ids(alone.json()), SAME, where=line["custom_id"])
    if endpoint == "/v1/score":
        check_scores_against_reference(lines, output, engine, reference)


def check_scores_against_reference(lines, output, engine, reference):
    bos = engine.info.bos_token_id
    for line in lines[:len(TEXTS)]:
        item = output[line["custom_id"]]["response"]["body"]["data"][0]
        ids = engine.tokenizer(line["body"]["input"], add_special_tokens=False).input_ids
        ref = reference.logprobs([bos] + ids).numpy()
        np.testing.assert_allclose(item["token_logprobs"], [ref[i][ids[i]] for i in range(len(ids))], atol=TOL)


def test_request_counts_move_as_lines_finish(served):
    client, _, _ = served
    oai = sdk(client)
    lines = [request_line(f"m{i}", "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 16,
                                                        "temperature": 0}) for i in range(24)]
    batch = oai.batches.create(input_file_id=oai.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch").id,
                               endpoint="/v1/completions", completion_window="24h")
    seen = set()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        current = oai.batches.retrieve(batch.id)
        seen.add(current.request_counts.completed)
        if current.status == "completed":
            break
    assert current.status == "completed" and 24 in seen and len(seen) >= 2
