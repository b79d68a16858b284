"""POST /v1/compare: two served models read the same tokens (`align: "tokens"`, the default); how far
apart are their next-token distributions at each position? KL divergence both ways, Jensen-Shannon,
top-1 agreement and each model's log probability of the actual token (docs/api.md, section 5.1).

Both models must share one tokenizer (the same vocabulary, token by token, and the same ids for this
text): the comparison is over one vocabulary. Each model runs the tokens once with the whole vocabulary
at every position (`prompt_logprobs: -1`), so the whole-vocabulary cap bounds the tokens. The two
[P, V] float32 rows are compared in float64 (output/divergence.py).

With `align: "text"`, two or more models of any tokenizers are compared on the text's spans instead:
the text spans' endpoint (spans.py; the registry sends such a request there), which shares `parse`,
`resolve` and `jobs` with this one.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from ...backend import GenerationOutput, GenerationRequest, SamplingParams
from ...config import Limits
from ...output.divergence import divergences, mean_or_none
from ...output.logprobs import NEG_INF_WIRE, TokenNamer, wire_floats
from ...tokens import TextAssembler
from ..checks.caps import check_request_caps, check_text_length
from ..checks.vocabulary import check_token_ids
from ..errors import InvalidRequest
from .protocol import CompareBody

INF_WIRE = 9999.0  # a divergence of 9999 nats or more, infinite included (as the API writes -inf: -9999.0)


@dataclass
class CompareRequest:
    models: list[str]
    input: str | list[int]
    context: str | None
    add_special_tokens: bool
    return_tokens_as_token_ids: bool
    align: str = "tokens"  # "text": any tokenizers, compared on the text's spans (spans.py)


@dataclass
class CompareItem:
    token_ids: list[int]  # what both models run: context + input
    first: int  # index of the input's first token in token_ids


def parse(body: dict, limits: Limits) -> CompareRequest:
    req = CompareBody.parse(body, limits)
    return CompareRequest(req.models, req.input, req.context, req.add_special_tokens, req.return_tokens_as_token_ids,
                          req.align)


def resolve(req: CompareRequest, resolve_model) -> tuple:
    """The backends (`resolve_model`: a name -> its backend, raising 404 `model_not_found`), each named
    once; with `align: "tokens"` the two must share a vocabulary."""
    found = []
    for name in req.models:
        backend = resolve_model(name, param="models")
        if backend in found:
            other = req.models[found.index(backend)]
            raise InvalidRequest(f"Invalid value for 'models': {other!r} and {name!r} are both the model "
                                 f"{backend.info.name}; name each model once.", "models")
        found.append(backend)
    if req.align == "tokens":
        check_same_vocabulary(*found)
    return tuple(found)


_VOCAB_CHECKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def check_same_vocabulary(a, b) -> None:
    """Refuse two models whose vocabularies differ (size, or any token's text); the answer is kept per
    pair of backends, since comparing 262,144 token strings takes a while."""
    known = _VOCAB_CHECKS.setdefault(a, weakref.WeakKeyDictionary())
    if b not in known:
        known[b] = _vocabulary_difference(a, b)
    if known[b] is not None:
        raise not_one_tokenizer(a, b, known[b])


def _vocabulary_difference(a, b) -> str | None:
    size_a, size_b = a.info.vocab_size, b.info.vocab_size
    if size_a != size_b:
        return f"vocabulary sizes {size_a} vs {size_b}"
    strings_a, strings_b = a.table.strings, b.table.strings
    if strings_a is strings_b:
        return None
    differ = np.flatnonzero(strings_a != strings_b)
    if len(differ):
        t = int(differ[0])
        return f"token {t} is {strings_a[t]!r} in one and {strings_b[t]!r} in the other"
    return None


def not_one_tokenizer(a, b, why: str) -> InvalidRequest:
    return InvalidRequest(f"The models {a.info.name} and {b.info.name} do not share a tokenizer ({why}); "
                          "/v1/compare compares two distributions over one vocabulary. To compare them on the "
                          "text's spans instead, send 'align': 'text'.", "models")


def tokenize(pair: tuple, req: CompareRequest) -> CompareItem:
    """context + input as both models' tokenizers read them; 400 if they differ. Like /v1/score, context and input are tokenized apart;
    the special tokens (BOS) go in front of the first of them."""
    (ids_a, first_a), (ids_b, first_b) = [_tokenize(backend, req) for backend in pair]
    if ids_a == ids_b and first_a != first_b:
        raise not_one_tokenizer(*pair, f"the context is {first_a} tokens in one and {first_b} in the other")
    if ids_a != ids_b:
        at = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
        token_a, token_b = (ids[at] if at < len(ids) else "nothing" for ids in (ids_a, ids_b))
        raise not_one_tokenizer(*pair, f"they tokenize this text differently: token {at} is {token_a} vs {token_b}")
    return CompareItem(ids_a, first_a)


def _tokenize(backend, req: CompareRequest) -> tuple[list[int], int]:
    tok, vocab = backend.tokenizer, backend.info.vocab_size
    check_text_length(backend, [req.input, req.context], "input")
    head = tok(req.context, add_special_tokens=req.add_special_tokens).input_ids if req.context else []
    if isinstance(req.input, str):
        ids = tok(req.input, add_special_tokens=req.add_special_tokens and not req.context).input_ids
    else:
        check_token_ids(req.input, vocab, "input")
        ids = list(req.input)
    if not ids:
        raise InvalidRequest("Invalid value for 'input': the input has no tokens.", "input")
    return list(head) + list(ids), len(head)


def check_caps(pair: tuple, req: CompareRequest, item: CompareItem, limits: Limits) -> None:
    """The context length of each model, then the whole-vocabulary cap (the smaller of the two models':
    every position of context and input is read whole)."""
    for backend in pair:
        check_request_caps(backend, [item.token_ids], SamplingParams(max_tokens=0), None, limits,
                           prompt_param="input", max_tokens_param="input")
    backend = min(pair, key=lambda b: limits.vocab_positions(b.info.vocab_size)[0])
    cap, flag = limits.vocab_positions(backend.info.vocab_size)
    num = len(item.token_ids)
    if num > cap:
        why = (f"{flag}: {limits.max_vocab_entries:,} positions x vocabulary entries, {cap} positions of "
               f"{backend.info.vocab_size:,} tokens" if flag == "max_vocab_entries" else flag)
        raise InvalidRequest(
            f"/v1/compare reads both models' whole vocabulary at every position, so it takes at most {cap} "
            f"tokens, context and input together ({why}; the model card's limits.vocab_positions); this "
            f"request has {num}. Send a shorter text.", "input")


def build_requests(pair: tuple, req: CompareRequest, item: CompareItem, request_id: str) -> list[GenerationRequest]:
    """One request per model: the tokens, nothing generated, every position's whole vocabulary."""
    params = SamplingParams(max_tokens=0, prompt_logprobs=-1)
    return [GenerationRequest(request_id, list(item.token_ids), params) for _ in pair]


def jobs(pair: tuple, requests: list[GenerationRequest]) -> list[tuple]:
    """Each model runs its own request; one hold counts both."""
    return [(backend, [request]) for backend, request in zip(pair, requests)]


def format_response(pair: tuple, req: CompareRequest, item: CompareItem, requests: list[GenerationRequest],
                    outputs: list[GenerationOutput]) -> tuple[dict, None]:
    """The comparison over the input's tokens (the context's are run, not compared). Position 0 of a
    text with nothing before it has no distribution: null in every list, left out of the summary."""
    a, b = pair
    cols_a, cols_b = outputs[0].prompt_columns, outputs[1].prompt_columns
    start = max(item.first, 1)  # the first row with a distribution
    found = divergences(cols_a.full[start:], cols_b.full[start:])
    ids = np.asarray(item.token_ids[item.first:], dtype=np.int64)
    namer = TokenNamer(a.table.strings, req.return_tokens_as_token_ids)
    lp_a, lp_b = cols_a.logprobs[start:], cols_b.logprobs[start:]  # [N] float32
    agree = found.top1_p == found.top1_q
    lead = [None] if item.first == 0 else []
    top1 = np.stack([found.top1_p, found.top1_q], axis=1)
    asm = TextAssembler(a.table)
    for t in ids.tolist():
        asm.add(t)
    positions = {
        "kl_pq": lead + _wire(found.kl_pq).tolist(),
        "kl_qp": lead + _wire(found.kl_qp).tolist(),
        "js": lead + found.js.tolist(),
        "top1": lead + top1.tolist(),
        "top1_tokens": lead + np.asarray(namer.names(top1.reshape(-1)), dtype=object).reshape(-1, 2).tolist(),
        "top1_agree": lead + agree.tolist(),
        "logprobs": lead + wire_floats(np.stack([lp_a, lp_b], axis=1)).tolist(),
    }
    summary = {
        "num_positions": len(found.js),
        "mean_kl_pq": _wire_one(mean_or_none(found.kl_pq)),
        "mean_kl_qp": _wire_one(mean_or_none(found.kl_qp)),
        "mean_js": mean_or_none(found.js),
        "top1_agreement": mean_or_none(agree.astype(np.float64)),
        "sum_logprob": [_wire_logprob(np.sum(lp, dtype=np.float64)) for lp in (lp_a, lp_b)],
    }
    total = len(item.token_ids) * 2
    return {"object": "comparison", "models": [a.info.name, b.info.name], "tokens": namer.names(ids),
            "token_ids": ids.tolist(), "text_offset": list(asm.offsets), "positions": positions,
            "summary": summary, "usage": {"prompt_tokens": total, "total_tokens": total}}, None


def _wire(values: np.ndarray) -> np.ndarray:
    """Divergences for JSON: 9999 nats or more (+inf included) as 9999.0."""
    return np.minimum(np.asarray(values, dtype=np.float64), INF_WIRE)


def _wire_one(value: float | None) -> float | None:
    return None if value is None else min(value, INF_WIRE)


def _wire_logprob(total) -> float:
    """A sum of float32 log probabilities, in float64; -inf as -9999.0."""
    return NEG_INF_WIRE if np.isneginf(total) else float(total)
