"""POST /v1/tree over the fake backend: its refusals (each naming its param, before anything is held or
queued), its caps in the model card, the hold, and the answer's shape and numbers against the fake
model's own function of the tokens."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from fake_backend import TinyTokenizer
from logprobe.api.app import create_app
from logprobe.backend import SamplingParams, TreeShape
from logprobe.config import Limits
from logprobe.engine.host.tree import Children, TreeGroup
from logprobe.tokens import TokenTable


def post(client, **body):
    body.setdefault("model", "tiny")
    return client.post("/v1/tree", json=body)


def refused(client, param: str, **body) -> str:
    r = post(client, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    return error["message"]


@pytest.mark.parametrize("body, param, words", [
    (dict(prompt="hi", depth=9), "depth", "less than or equal to 8"),
    (dict(prompt="hi", depth=0), "depth", "greater than or equal to 1"),
    (dict(prompt="hi", branches=21), "branches", "less than or equal to 20"),
    (dict(prompt="hi", branches=0), "branches", "greater than or equal to 1"),
    (dict(prompt="hi", depth=5, branches=5), "depth", "max_tree_nodes"),
    (dict(prompt="hi", depth=1, branches=20, branch_p=0), "branch_p", "greater than 0"),
    (dict(prompt="hi", branch_p=1.5), "branch_p", "less than or equal to 1"),
    (dict(prompt="hi", depth="3"), "depth", "Invalid type"),
    (dict(), None, "Missing required parameter: 'prompt' (or 'messages')"),
    (dict(prompt="hi", messages=[{"role": "user", "content": "hi"}]), "messages", "not both"),
    (dict(prompt=[]), "prompt", "non-empty"),
    (dict(prompt=[1, "a"]), "prompt", "array of token ids"),
    (dict(prompt=[10 ** 7]), "prompt", "outside the vocabulary"),
    (dict(prompt="hi", temperature=3), "temperature", "less than or equal to 2"),
    (dict(prompt="hi", max_tokens=3), "max_tokens", "Unrecognized"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages", "role"),
])
def test_refusals_name_the_param(fake_client, fake_backend, body, param, words):
    fake_backend.reset_records()
    message = refused(fake_client, param, **body)
    assert words in message, message
    assert fake_backend.calls == []  # nothing reached the engine


def test_context_refusals(fake_client, fake_backend):
    fake_backend.reset_records()
    refused(fake_client, "prompt", prompt=[5] * 256, depth=1)
    refused(fake_client, "depth", prompt=[5] * 250, depth=8, branches=2)
    assert fake_backend.calls == []


def test_caps_in_the_card_and_from_the_server(fake_backend):
    limits = Limits(max_tree_depth=3, max_tree_branches=4, max_tree_nodes=30, max_tokens_in_flight=40)
    with TestClient(create_app(fake_backend, limits), raise_server_exceptions=False) as c:
        card = c.get("/v1/models/tiny").json()["limits"]
        assert (card["max_tree_depth"], card["max_tree_branches"], card["max_tree_nodes"]) == (3, 4, 30)
        assert "less than or equal to 3" in refused(c, "depth", prompt="hi", depth=4)
        assert "less than or equal to 4" in refused(c, "branches", prompt="hi", branches=5)
        assert "30 (max_tree_nodes)" in refused(c, "depth", prompt="hi", depth=3, branches=4)  # 84 nodes
        # the hold is the prompt and the whole tree (14 nodes): 3 + 14 fits 40, 30 + 14 does not
        assert post(c, prompt=[5, 6, 7], depth=3, branches=2).status_code == 200
        assert "max_tokens_in_flight" in refused(c, "depth", prompt=[5] * 30, depth=3, branches=2)


def test_answer_matches_the_fake_model(fake_client, fake_backend):
    fake_backend.reset_records()
    r = post(fake_client, prompt=[5, 6, 7], depth=3, branches=2, temperature=0.5, return_tokens_as_token_ids=True)
    assert r.status_code == 200, r.text
    tree = r.json()
    (call,) = fake_backend.calls
    (request,) = call.requests
    assert request.tree == TreeShape(3, 2) and request.held_tokens == 3 + 14
    nodes = tree["nodes"]
    assert len(nodes) == 14 and tree["roots"] == [0, 1]
    assert tree["usage"] == {"prompt_tokens": 3, "completion_tokens": 14, "total_tokens": 17, "forward_tokens": 9}
    for node in nodes:
        path, parent = [node["token_id"]], node["parent"]
        while parent is not None:
            path.insert(0, nodes[parent]["token_id"])
            parent = nodes[parent]["parent"]
        row = fake_backend.logprobs_after([5, 6, 7] + path[:-1])
        assert node["token"] == f"token_id:{node['token_id']}"
        assert node["logprob"] == pytest.approx(float(row[node["token_id"]]), abs=1e-6)
        assert node["rank"] == int((row > row[node["token_id"]]).sum()) + 1
        assert node["depth"] == len(path)
        assert node["cumulative_logprob"] == pytest.approx(float(sum(
            fake_backend.logprobs_after([5, 6, 7] + path[:i])[t] for i, t in enumerate(path))), abs=1e-5)
        assert all(nodes[c]["parent"] == node["index"] for c in node["children"])


def test_the_openapi_schema_has_the_body(fake_client):
    schema = fake_client.get("/openapi.json").json()
    body = schema["paths"]["/v1/tree"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/TreeBody")
    fields = schema["components"]["schemas"]["TreeBody"]["properties"]
    assert {"prompt", "messages", "depth", "branches", "branch_p", "temperature"} <= set(fields)


def test_a_stop_token_is_a_leaf():
    """The host-side growth the engine and the fake share: a stop token is recorded, not expanded, and
    cumulative log probabilities add along the path."""
    tok = TinyTokenizer()
    tree = TreeGroup("t", [1, 2], SamplingParams(max_tokens=2, stop_token_ids=frozenset({257})),
                     TokenTable.build(tok, 258), TreeShape(2, 2))
    first = Children(np.array([2]), np.array([[257, 65]]), np.array([[-0.5, -1.0]], np.float32),
                     np.array([[-0.4, -1.1]], np.float32), np.array([[1, 2]]), np.array([0.9], np.float32))
    tree.grow(first)
    assert tree.frontier == [1] and not tree.is_finished and tree.is_stop == [True, False]
    tree.grow(Children(np.array([1]), np.array([[66, 0]]), np.array([[-2.0, 0]], np.float32),
                       np.array([[-2.0, 0]], np.float32), np.array([[1, 0]]), np.array([1.5], np.float32)))
    assert tree.is_finished and tree.parents == [-1, -1, 1]
    out = tree.output().tree
    assert out.cumulative_logprobs.tolist() == [-0.5, -1.0, -3.0]
    assert out.num_forward_tokens == 2 + 1
