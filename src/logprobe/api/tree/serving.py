"""POST /v1/tree: the token tree below a prompt, every node's numbers in one answer.

From the prompt (a text, token ids, or chat messages through the template), each node's likeliest
children in the processed distribution (the one a token would be drawn from: temperature, top-k,
top-p, a constraint) are expanded to `depth` tokens; a stop token (end of text) is a leaf. Why a route of
its own rather than `max_tokens: 1` requests: the engine runs the prompt once and each level of the
tree as one pass over its nodes, reusing the keys and values of the prompt and of each node's ancestors
(engine/host/tree.py), where one request per inner node runs the prompt again every time.

The answer lists the nodes breadth first (the likeliest sibling first), each with its parent and
children by index, so a client can walk it either way. Choices made where nothing is prescribed:
`rank` is the token's rank in the raw distribution (1: the likeliest); `entropy` is that of the raw
distribution the token is in (its parent's, the same for siblings); `text` is the continuation from the
prompt's end through the node, and `text_offset` where the node's token starts in it.
"""

from __future__ import annotations

from ...backend import GenerationOutput, GenerationRequest, SamplingParams
from ...config import Limits
from ...output.logprobs import TokenNamer, wire_floats
from ...tokens import TextAssembler
from ..checks.caps import check_request_caps, check_text_length
from ..checks.messages import render
from ..checks.steering import check_steering, with_bad_words
from ..checks.vocabulary import check_token_ids
from ..errors import InvalidRequest
from .protocol import TreeBody


def parse(body: dict, limits: Limits) -> TreeBody:
    return TreeBody.parse(body, limits)


def tokenize(backend, req: TreeBody) -> list[int]:
    """The prompt's token ids: a text through the tokenizer, ids as given, messages through the template."""
    tok, info = backend.tokenizer, backend.info
    if req.messages is not None:
        if not info.has_chat_template:
            raise InvalidRequest("This model has no chat template, so 'messages' cannot be turned into a prompt. "
                                 "Send a 'prompt' instead, or start the server with --chat-template FILE.",
                                 "messages")
        check_text_length(backend, [m.get("content") for m in req.messages], "messages")
        return tok(render(backend, req.messages), add_special_tokens=False).input_ids  # as chat renders
    if isinstance(req.prompt, str):
        check_text_length(backend, [req.prompt], "prompt")
        ids = tok(req.prompt, add_special_tokens=req.add_special_tokens).input_ids
        if not ids:
            raise InvalidRequest("Invalid value for 'prompt': the text has no tokens.", "prompt")
        return ids
    check_token_ids(req.prompt, info.vocab_size, "prompt")
    return list(req.prompt)


def params_of(backend, req: TreeBody) -> SamplingParams:
    """What shapes the processed distribution; `max_tokens` is the depth (the context must hold it)."""
    params = SamplingParams(max_tokens=req.depth, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                            stop_token_ids=backend.info.stop_token_ids, constraint=req.constraint,
                            logit_bias=req.logit_bias, allowed_token_ids=req.allowed_token_ids)
    return with_bad_words(backend, params, req.bad_words)


def check_caps(backend, req: TreeBody, ids: list[int], limits: Limits) -> None:
    prompt_param, params = "messages" if req.messages is not None else "prompt", params_of(backend, req)
    check_steering(backend, params)
    check_request_caps(backend, [ids], params, None, limits, prompt_param=prompt_param, max_tokens_param="depth")
    held = len(ids) + req.shape.max_nodes
    if held > limits.max_tokens_in_flight:
        raise InvalidRequest(
            f"This tree needs {held} tokens (prompt tokens + its largest number of nodes), more than this server "
            f"ever holds at once ({limits.max_tokens_in_flight}, max_tokens_in_flight). Lower 'depth' or "
            "'branches', or shorten the prompt.", "depth")


def build_requests(backend, req: TreeBody, ids: list[int], request_id: str) -> list[GenerationRequest]:
    return [GenerationRequest(request_id, ids, params_of(backend, req), tree=req.shape)]


def format_response(backend, req: TreeBody, ids: list[int], requests: list[GenerationRequest],
                    outputs: list[GenerationOutput]) -> tuple[dict, None]:
    tree = outputs[0].tree
    namer = TokenNamer(backend.table.strings, req.return_tokens_as_token_ids)
    names = namer.names(tree.token_ids)
    parents = tree.parents.tolist()
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if parent >= 0:
            children[parent].append(node)
    logprobs, processed = wire_floats(tree.logprobs).tolist(), wire_floats(tree.processed_logprobs).tolist()
    cumulative, entropies = tree.cumulative_logprobs.tolist(), tree.entropies.astype(float).tolist()
    token_ids, depths, ranks = tree.token_ids.tolist(), tree.depths.tolist(), tree.ranks.tolist()
    nodes = []
    for node, parent in enumerate(parents):
        text, offset = continuation(backend.table, token_ids, parents, node)
        nodes.append({"index": node, "parent": None if parent < 0 else parent, "children": children[node],
                      "depth": depths[node], "token": names[node], "token_id": token_ids[node],
                      "bytes": list(backend.table.token_bytes[token_ids[node]]), "text": text,
                      "text_offset": offset, "logprob": logprobs[node], "processed_logprob": processed[node],
                      "cumulative_logprob": cumulative[node], "rank": ranks[node], "entropy": entropies[node],
                      "is_stop": bool(tree.is_stop[node])})
    roots = [node for node, parent in enumerate(parents) if parent < 0]
    return {"object": "token_tree", "model": backend.info.name, "prompt_token_ids": list(ids),
            "depth": req.depth, "branches": req.branches, "branch_p": req.branch_p, "roots": roots, "nodes": nodes,
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(parents),
                      "total_tokens": len(ids) + len(parents), "forward_tokens": tree.num_forward_tokens}}, None


def continuation(table, token_ids: list[int], parents: list[int], node: int) -> tuple[str, int]:
    """The text from the prompt's end through `node`, and where the node's own token starts in it."""
    path = []
    while node >= 0:
        path.append(token_ids[node])
        node = parents[node]
    text = TextAssembler(table)
    for token in reversed(path):
        text.add(token)
    text.finish()
    return text.text, text.offsets[-1]
