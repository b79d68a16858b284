"""`structured_outputs.choice` decided by each answer's own log probability (docs/api.md, 2.6).

A token-by-token pick under a choice list's grammar answers another question: its first step may
take a token that several answers start with (" " before "yes" and "no") on mass that mostly goes on
outside them. What a user of `choice` asks is which answer the model finds likeliest, so each answer
is scored whole, as `/v1/score` reads an input after a context: the answer's text is encoded on its
own (no special tokens) and appended to the prompt's tokens as they are, the tokens not merged across
the boundary; its log probability is the sum of its tokens'. The scoring requests are prompt-only
passes of the prompt plus each answer, which share the prompt's pass (engine: shared prefixes and the
prefix cache). Greedy takes the likeliest answer (the first of equals); sampling draws answer i with
probability ∝ exp(logprob_i / temperature), after `top_k` and `top_p` over the answers, from the
choice's seeded stream. Each sequence then spells its answer's tokens (engine/host/forced.py), so its
`logprobs` are the model's numbers for exactly the tokens emitted.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np

from ...backend import GenerationRequest, SamplingParams
from ...config import Limits
from ...engine.host.forced import ChoiceDecision
from ...engine.host.random_streams import Stream
from ..errors import ContextLengthExceeded, InvalidRequest

PARAM = "structured_outputs.choice"


def is_choice(params: SamplingParams) -> bool:
    return params.constraint is not None and params.constraint.kind == "choice"


def answers_of(backend, params: SamplingParams) -> tuple[list[str], list[list[int]]]:
    """A choice list's texts and each one's tokens, encoded on its own."""
    texts = json.loads(params.constraint.source)
    return texts, [list(backend.tokenizer(text, add_special_tokens=False).input_ids) for text in texts]


def check_context(backend, requests: list[GenerationRequest], answer_ids: list[list[int]]) -> None:
    """Every answer is scored whole after the prompt: prompt and answer fit the context."""
    ctx = backend.info.context_length
    longest = max(range(len(answer_ids)), key=lambda i: len(answer_ids[i]))
    for request in requests:
        total = len(request.prompt_ids) + len(answer_ids[longest])
        if total > ctx:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {ctx} tokens. However, the choice at index {longest} "
                f"is {len(answer_ids[longest])} tokens, which with the prompt's {len(request.prompt_ids)} "
                f"makes {total}: each choice is scored whole after the prompt. Please reduce the prompt or "
                "the choices.", PARAM)


def check_count(num_prompts: int, num_answers: int, limits: Limits) -> None:
    """Every answer is scored after every prompt, as /v1/score scores its inputs: at most max_prompts
    scored texts in one request, as there."""
    if num_prompts * num_answers > limits.max_prompts:
        per = f" x {num_prompts} prompts = {num_prompts * num_answers}" if num_prompts > 1 else ""
        raise InvalidRequest(f"Too many choices: each answer of '{PARAM}' is scored whole after each prompt, as "
                             f"/v1/score scores its inputs, and this server scores at most {limits.max_prompts} "
                             f"texts in one request (max_prompts); this one has {num_answers} answers{per}. "
                             "Send fewer choices (or prompts).", PARAM)


def scored_tokens(requests: list[GenerationRequest]) -> int:
    """The tokens the requests' choice lists were scored with (0 without one): what usage adds to the
    prompt tokens, as the key's budget was charged them."""
    return sum(ChoiceDecision.of(r.params.constraint).scored_tokens for r in requests
               if r.params.constraint is not None and r.params.constraint.kind == "chosen")


async def decided(run, backend, requests: list[GenerationRequest], limits: Limits) -> list[GenerationRequest]:
    """`requests` with every choice list decided: the answers scored after each prompt (one job, given
    to `run`: a list of (backend, requests) jobs -> their outputs, run under a hold by the pipeline:
    the scoring's tokens are held and charged to the key as /v1/score's would be), each sequence's
    answer drawn, and the constraint replaced by the decision (kind "chosen"). Requests without a
    choice list are returned as they are."""
    if not requests or requests[0].tree is not None or not is_choice(requests[0].params):
        return requests
    texts, answer_ids = answers_of(backend, requests[0].params)
    check_count(len(requests), len(texts), limits)
    check_context(backend, requests, answer_ids)
    drawable = np.array([is_drawable(requests[0].params, ids) for ids in answer_ids])
    if not drawable.any():
        field = "allowed_token_ids" if requests[0].params.allowed_token_ids is not None else "bad_words"
        raise InvalidRequest(f"No choice can be generated: every choice in '{PARAM}' spells a token that "
                             f"'{field}' rules out. Change one of the two.", PARAM)
    scoring = [GenerationRequest(r.request_id, list(r.prompt_ids) + ids,
                                 SamplingParams(max_tokens=0, echo=True, logprobs=0), priority=r.priority)
               for r in requests for ids in answer_ids]
    (outputs,) = await run([(backend, scoring)])
    out = []
    for i, r in enumerate(requests):
        first = len(r.prompt_ids)
        logprobs = [float(np.sum(o.prompt_columns.logprobs[first:], dtype=np.float64))
                    for o in outputs[i * len(texts):(i + 1) * len(texts)]]
        picks = tuple(draw(np.where(drawable, logprobs, -np.inf), r.params, j) for j in range(r.params.n))
        scored = sum(len(r.prompt_ids) + len(ids) for ids in answer_ids)
        decision = ChoiceDecision(tuple(texts), tuple(map(tuple, answer_ids)), tuple(logprobs), picks, scored)
        out.append(replace(r, params=replace(r.params, constraint=decision.constraint())))
    return out


def is_drawable(params: SamplingParams, ids: list[int]) -> bool:
    """Whether an answer's tokens pass `allowed_token_ids` and `bad_words` (an answer that spells a
    banned token, or a bad word's tokens in a row, is never drawn; its log probability is still reported)."""
    if params.allowed_token_ids is not None and not set(ids) <= set(params.allowed_token_ids):
        return False
    return not any(tuple(ids[i:i + len(word)]) == tuple(word)
                   for word in params.bad_words_ids for i in range(len(ids) - len(word) + 1))


def draw(logprobs: np.ndarray, params: SamplingParams, index: int) -> int:
    """The answer choice `index` of the request spells: the likeliest when greedy, else drawn in
    proportion to exp(logprob / temperature) among the answers top_k and top_p keep."""
    if params.is_greedy or not np.isfinite(logprobs).any():
        return int(np.argmax(logprobs))
    probs = answer_probabilities(logprobs, params.temperature, params.top_k, params.top_p)
    # the choice's own seeded stream, at the step before its first token's (never a token's numbers)
    u = np.random.default_rng(Stream(params.seed, index).seed(-1)).random()
    return int(min(np.searchsorted(np.cumsum(probs), u, side="right"), len(probs) - 1))


def answer_probabilities(logprobs: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """[K] float64: the distribution answers are drawn from: softmax(logprob / temperature) over the
    top_k likeliest answers (all for top_k <= 0), then the smallest prefix of them, likeliest first,
    whose mass reaches top_p (the sampler's filters, engine/device/sampler.py, over answers)."""
    scores = (logprobs - logprobs.max()) / temperature
    order = np.argsort(-scores, kind="stable")
    keep = np.zeros(len(scores), dtype=bool)
    keep[order[:top_k] if top_k > 0 else order] = True
    probs = np.where(keep, np.exp(scores), 0.0)
    probs /= probs.sum()
    before = np.cumsum(probs[order]) - probs[order]
    dropped = order[1:][before[1:] >= top_p]  # the likeliest answer is always kept
    probs[dropped] = 0.0
    return probs / probs.sum()


def block(params: SamplingParams) -> list[dict] | None:
    """`choice_logprobs` of a decided request's choices: each answer of the list, in its order, with its
    log probability after the prompt and its number of tokens; None for any other request."""
    if params.constraint is None or params.constraint.kind != "chosen":
        return None
    decision = ChoiceDecision.of(params.constraint)
    return [{"text": text, "logprob": logprob, "num_tokens": len(ids)}
            for text, ids, logprob in zip(decision.texts, decision.token_ids, decision.logprobs)]
