"""POST /v1/compare with `align: "text"`, an endpoint of its own on that path (registry.py `TEXT_SPANS`;
`parse`, `resolve` and `jobs` are serving.py's): two or more served models of any tokenizers read one text;
each model's log probability of every span where all their tokenizations have a boundary, the
differences, bits per byte, and the spans where they disagree most (docs/api.md, section 5.1).

Each model scores the text exactly as /v1/score does by default (its BOS, or its end-of-text token,
in front; context and input tokenized apart; the same engine request), so the comparison costs the
models' scoring passes and nothing more: no whole-vocabulary rows. The tokenizations are aligned on
the text's bytes (output/spans.py) and each span's log probability is the float64 sum of its tokens'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...backend import GenerationOutput, GenerationRequest
from ...config import Limits
from ...output.logprobs import NEG_INF_WIRE, TokenNamer, wire_floats
from ...output.spans import Alignment, Misspelled, align
from ...tokens import TextAssembler
from ..errors import InvalidRequest
from ..score import serving as scoring

NUM_DISAGREEMENTS = 10  # spans listed in `disagreements`, the largest spread first


@dataclass
class SpanItem:
    scored: list[scoring.ScoreItem]  # one per model: what it runs, as /v1/score builds it
    alignment: Alignment


def score_request(req, backend) -> scoring.ScoreRequest:
    """The /v1/score request one model answers: the text, its context, the BOS rule of `add_bos`."""
    return scoring.ScoreRequest(model=backend.info.name, inputs=[req.input], contexts=[req.context],
                                add_bos=req.add_special_tokens, top_logprobs=None,
                                return_tokens_as_token_ids=req.return_tokens_as_token_ids, residual=None)


def tokenize(models: tuple, req) -> SpanItem:
    """Each model's tokens of context and input; the input's tokens aligned on its bytes (400 if a
    tokenizer does not spell the text back byte for byte, e.g. one that normalizes it)."""
    scored = [scoring.tokenize(backend, score_request(req, backend))[0] for backend in models]
    if any(item.first == 0 for item in scored):
        raise InvalidRequest("Invalid value for 'add_special_tokens': with 'align': 'text' every token of the input "
                             "is scored, so something must come before its first token: leave add_special_tokens "
                             "true (each model's BOS, or its end-of-text token, in front) or send a 'context'.",
                             "add_special_tokens")
    pieces = [[backend.table.token_bytes[t] for t in item.token_ids[item.first:]]
              for backend, item in zip(models, scored)]
    try:
        alignment = align(req.input, pieces)
    except Misspelled as exc:
        name = models[exc.which].info.name
        raise InvalidRequest(f"Invalid value for 'input': the tokens of {name} do not spell the text back (they "
                             f"differ from its UTF-8 at byte {exc.at}; the tokenizer changes the text), so its "
                             "tokens cannot be aligned with the other models'. Compare it with 'align': 'tokens' "
                             "or leave it out.", "input") from None
    return SpanItem(scored, alignment)


def check_caps(models: tuple, req, item: SpanItem, limits: Limits) -> None:
    """Each model's context length and scoring caps, as /v1/score checks them."""
    for backend, scored in zip(models, item.scored):
        scoring.check_caps(backend, score_request(req, backend), [scored], limits)


def build_requests(models: tuple, req, item: SpanItem, request_id: str) -> list[GenerationRequest]:
    """One /v1/score request per model."""
    return [scoring.build_requests(backend, score_request(req, backend), [scored], request_id)[0]
            for backend, scored in zip(models, item.scored)]


def format_response(models: tuple, req, item: SpanItem, requests: list[GenerationRequest],
                    outputs: list[GenerationOutput]) -> tuple[dict, None]:
    al = item.alignment
    token_lps = [out.prompt_columns.logprobs[scored.first:] for scored, out in zip(item.scored, outputs)]
    # [S, M] float64; -inf written as the wire's -9999.0 before differences are taken
    span_lps = np.maximum(np.stack([al.span_sums(m, lp) for m, lp in enumerate(token_lps)], axis=1), NEG_INF_WIRE)
    difference = span_lps[:, 1:] - span_lps[:, :1]
    spread = span_lps.max(axis=1) - span_lps.min(axis=1)
    num_bytes = int(al.bounds[-1])
    totals = span_lps.sum(axis=0)
    edges = al.char_bounds.tolist()
    spans = {
        "text": [req.input[s:e] for s, e in zip(edges[:-1], edges[1:])],
        "text_offset": edges[:-1],
        "byte_offset": al.bounds[:-1].tolist(),
        "logprobs": span_lps.tolist(),
        "difference": difference.tolist(),
        "spread": spread.tolist(),
        "num_tokens": np.stack([al.span_counts(m) for m in range(len(models))], axis=1).tolist(),
    }
    summary = {
        "num_spans": al.num_spans, "num_bytes": num_bytes, "num_characters": len(req.input),
        "logprob": totals.tolist(),
        "num_tokens": [len(lp) for lp in token_lps],
        "bits_per_byte": [-total / math.log(2) / num_bytes for total in totals.tolist()],
    }
    order = np.argsort(-spread, kind="stable")[:NUM_DISAGREEMENTS]
    tokenizations = [_tokenization(backend, req, scored, al, m, lp)
                     for m, (backend, scored, lp) in enumerate(zip(models, item.scored, token_lps))]
    total = sum(len(scored.token_ids) for scored in item.scored)
    return {"object": "span_comparison", "models": [b.info.name for b in models], "spans": spans,
            "disagreements": order.tolist(), "summary": summary, "tokenizations": tokenizations,
            "usage": {"prompt_tokens": total, "total_tokens": total}}, None


def _tokenization(backend, req, scored: scoring.ScoreItem, al: Alignment, which: int, logprobs) -> dict:
    """One model's own tokens of the input, with their log probabilities, offsets and spans."""
    ids = np.asarray(scored.token_ids[scored.first:], dtype=np.int64)
    asm = TextAssembler(backend.table)
    for t in ids.tolist():
        asm.add(t, special_text=True)  # a special token written in the text is its own text here
    namer = TokenNamer(backend.table.strings, req.return_tokens_as_token_ids)
    return {"model": backend.info.name, "tokens": namer.names(ids), "token_ids": ids.tolist(),
            "token_logprobs": wire_floats(logprobs).tolist(), "text_offset": list(asm.offsets),
            "byte_offset": al.token_bytes[which].tolist(), "span": al.token_spans[which].tolist()}
