"""POST /v1/score: the log-likelihood of texts you already have, token by token; no generation.

Context and input are tokenized apart (no special tokens) and concatenated, as evaluation harnesses
do; with `add_bos` the model's BOS (or, without one, its end-of-text token) goes in front, so the
input's first token is scored too. Only the input's tokens are scored. The numbers come from the same
engine path as /v1/completions with `echo`, `logprobs` and `max_tokens: 0`, so they are the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ...backend import Constraint, GenerationOutput, GenerationRequest, SamplingParams
from ...config import Limits
from ...output.logprobs import TokenNamer, legacy_logprobs
from ...tokens import TextAssembler
from ..checks.caps import check_request_caps, check_text_length
from ..checks.sampling import ResidualRequest
from ..checks.vocabulary import check_token_ids
from ..errors import InvalidRequest
from ..serving.output_blocks import residual_layers, residual_of
from . import constrained as constrained_scoring
from . import conversation as chat_scoring
from . import fields as score_fields
from . import position_ids
from .items import ScoreItem
from .protocol import ScoreBody


@dataclass
class ScoreRequest:
    model: str
    inputs: list  # list[str] or list[list[int]]
    contexts: list[str | None]
    add_bos: bool
    top_logprobs: int | None
    return_tokens_as_token_ids: bool
    residual: ResidualRequest | None
    constraint: Constraint | None = None  # score under it (constrained.py)
    constraint_param: str = "structured_outputs"
    position_stats: bool = False  # each entry's entropy per position
    # a conversation instead of inputs (conversation.py): the turns scored, or candidate next turns
    messages: list[dict] | None = None
    scored_turns: list[int] = field(default_factory=list)
    replies: list[str] | None = None
    include_end_of_turn: bool = True
    # asked ids (position_ids.py): one tuple for every scored position, or per entry one tuple per position
    logprob_token_ids: tuple | list = ()
    conversations: list[list[dict]] | None = None  # several conversations, scored_turns: one turn each


def parse(body: dict, limits: Limits) -> ScoreRequest:
    req = ScoreBody.parse(body, limits)
    return ScoreRequest(req.model, req.input or [], req.contexts, req.add_bos, req.top_logprobs,
                        req.return_tokens_as_token_ids, req.output_residual_stream, req.constraint,
                        req.constraint_param, bool(req.position_stats), req.messages,
                        score_fields.scored_turns(req) if req.messages is not None or req.conversations is not None
                        else [], req.replies, req.include_end_of_turn is not False, req.logprob_token_ids,
                        req.conversations)


def request(model: str, *, input: str | list[str] | list[int] | list[list[int]] | None = None,
            context: str | list[str] | None = None, messages: list[dict] | None = None, add_bos: bool = True,
            top_logprobs: int | None = None, position_stats: bool = False,
            logprob_token_ids: list | None = None, limits: Limits | None = None) -> ScoreRequest:
    """The typed request of a caller in this process (a dataset's row, the score CLI), one keyword argument
    a field of the body: `input` (after `context`), or `messages` (a conversation, its last assistant turn
    scored), and what to compute. Every argument gets the checks of its field and the body's cross-field
    rules (ScoreBody.parse, `limits`: the caps, their defaults unless given), so a value /v1/score would
    refuse is refused here with the same message and `param`."""
    fields = {"model": model, "input": input, "context": context, "messages": messages, "add_bos": add_bos,
              "top_logprobs": top_logprobs, "position_stats": position_stats,
              "logprob_token_ids": logprob_token_ids}
    return parse({name: value for name, value in fields.items() if value is not None}, limits or Limits())


def tokenize(backend, req: ScoreRequest) -> list[ScoreItem]:
    chat = req.messages is not None or req.conversations is not None
    items = chat_scoring.tokenize(backend, req) if chat else _tokenize_inputs(backend, req)
    position_ids.check(backend, req.logprob_token_ids, items)
    return items


def _tokenize_inputs(backend, req: ScoreRequest) -> list[ScoreItem]:
    tok, info = backend.tokenizer, backend.info
    start_id = info.bos_token_id if info.bos_token_id is not None else info.eos_token_id
    items = []
    for i, (inp, ctx) in enumerate(zip(req.inputs, req.contexts)):
        check_text_length(backend, [inp, ctx], "context" if isinstance(ctx, str) and len(ctx) > len(inp) else "input")
        head = [start_id] if req.add_bos and start_id is not None else []
        if ctx:
            head += tok(ctx, add_special_tokens=False).input_ids
        if isinstance(inp, str):
            ids = tok(inp, add_special_tokens=False).input_ids
        else:
            check_token_ids(inp, info.vocab_size, "input")
            ids = list(inp)
            if head == [start_id] and ids and ids[0] == start_id:
                head = []  # the ids already start with it
        if not ids:
            raise InvalidRequest(f"Invalid value for 'input': input {i} has no tokens.", "input")
        items.append(ScoreItem(head + ids, len(head), inp if isinstance(inp, str) else None))
    if req.constraint is not None:
        checks = constrained_scoring.check_inputs(backend, req.constraint, req.constraint_param,
                                                  [it.token_ids[it.first:] for it in items])
        for item, check in zip(items, checks):
            item.constraint_check = check
    return items


def check_caps(backend, req: ScoreRequest, items: list[ScoreItem], limits: Limits) -> None:
    params = SamplingParams(max_tokens=0, echo=True, logprobs=req.top_logprobs or 0)
    check_request_caps(backend, [it.token_ids for it in items], params, req.residual, limits,
                       prompt_param="input", max_tokens_param="input", positions_param="input")
    if req.constraint is not None:
        constrained_scoring.check_cap(backend, [it.token_ids for it in items], req.residual is not None, limits)


def build_requests(backend, req: ScoreRequest, items: list[ScoreItem], request_id: str) -> list[GenerationRequest]:
    params = SamplingParams(max_tokens=0, echo=True, logprobs=req.top_logprobs or 0,
                            residual_layers=residual_layers(backend, req.residual),
                            prompt_logprobs=-1 if req.constraint is not None else None,
                            position_stats=req.position_stats)
    return [GenerationRequest(request_id, it.token_ids, p)
            for it, p in zip(items, position_ids.params_of(req.logprob_token_ids, items, params))]


@dataclass
class ScoreEntry:
    """One /v1/score entry as the API computes it, typed: what an in-process caller (a dataset job) reads,
    and what `to_json` writes as the answer's entry. `blocks` holds the asked blocks after the numbers
    (`constraint`, `position_stats`, `logprob_token_ids`, `residual_stream`), as the answer writes them."""

    index: int
    message_index: int | None
    tokens: list  # each token's string (or `token_id:N`)
    token_ids: list[int]
    token_logprobs: list  # float, or None for a first token nothing predicts
    token_ranks: list  # int, or None as above
    text_offset: list[int]
    top_logprobs: list | None  # with `top_logprobs`: a {token: logprob} per position
    logprob: float
    mean_logprob: float | None
    perplexity: float | None
    num_tokens: int
    is_greedy: bool
    blocks: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        turn = {} if self.message_index is None else {"message_index": self.message_index}
        entry = {"index": self.index, **turn, "tokens": self.tokens, "token_ids": self.token_ids,
                 "token_logprobs": self.token_logprobs, "token_ranks": self.token_ranks,
                 "text_offset": self.text_offset}
        if self.top_logprobs is not None:
            entry["top_logprobs"] = self.top_logprobs
        entry.update({"logprob": self.logprob, "mean_logprob": self.mean_logprob, "perplexity": self.perplexity,
                      "num_tokens": self.num_tokens, "is_greedy": self.is_greedy})
        entry.update(self.blocks)
        return entry


def entries(backend, req: ScoreRequest, items: list[ScoreItem], outputs: list[GenerationOutput]) -> list[ScoreEntry]:
    """Each entry's numbers from the engine's outputs: only the input's tokens are scored."""
    namer = TokenNamer(backend.table.strings, req.return_tokens_as_token_ids)
    out_entries = []
    for index, (item, out) in enumerate(zip(items, outputs)):
        pc = out.prompt_columns
        sl = slice(item.first, len(item.token_ids))
        ids = np.asarray(item.token_ids[sl], dtype=np.int64)
        asm = TextAssembler(backend.table)
        for t in ids.tolist():
            asm.add(t)
        k = req.top_logprobs or 0
        shaped = legacy_logprobs(namer, ids, pc.logprobs[sl], pc.top_ids[sl, :k], pc.top_logprobs[sl, :k],
                                 asm.offsets, first_is_null=item.first == 0)
        scored = pc.logprobs[sl][1:] if item.first == 0 else pc.logprobs[sl]
        ranks = pc.ranks[sl][1:] if item.first == 0 else pc.ranks[sl]
        num = len(scored)
        total_lp = float(np.sum(scored, dtype=np.float64))
        mean = total_lp / num if num else None
        token_ranks = pc.ranks[sl].tolist()
        if item.first == 0:
            token_ranks[0] = None
        blocks = {}
        if req.constraint is not None:
            blocks["constraint"] = constrained_scoring.block(item.constraint_check, pc.full, ids, item.first)
        if req.position_stats:
            entropy = pc.extras.entropy[sl].astype(np.float64).tolist()
            if item.first == 0:
                entropy[0] = None  # nothing predicts the first token
            blocks["position_stats"] = {"entropy": entropy}
        if req.logprob_token_ids:
            blocks["logprob_token_ids"] = position_ids.block(req, index, pc.extras, sl, item.first == 0)
        if req.residual is not None:  # the input's tokens, in the order of the lists above
            blocks["residual_stream"] = residual_of(backend, req.residual, out.choices[0], sl)
        out_entries.append(ScoreEntry(
            index, item.message_index, shaped["tokens"], ids.tolist(), shaped["token_logprobs"], token_ranks,
            shaped["text_offset"], shaped["top_logprobs"] if req.top_logprobs is not None else None, total_lp,
            mean, _perplexity(mean), num, bool(np.all(ranks == 1)), blocks))
    return out_entries


def format_response(backend, req: ScoreRequest, items: list[ScoreItem], requests: list[GenerationRequest],
                    outputs: list[GenerationOutput]) -> tuple[dict, None]:
    total = sum(len(item.token_ids) for item in items)
    return {"object": "list", "model": backend.info.name,
            "data": [entry.to_json() for entry in entries(backend, req, items, outputs)],
            "usage": {"prompt_tokens": total, "total_tokens": total}}, None


def _perplexity(mean: float | None) -> float | None:
    """exp(-mean); null where there is no token to average or it overflows a double."""
    if mean is None or -mean > 709.0:
        return None
    return math.exp(-mean)
