"""/v1/score under a constraint (docs/api.md, "Constrained decoding"): the input is read under the
grammar (a 400 says at which token and character it leaves it), the engine returns each position's
whole raw distribution, and the answer adds, per input token, the log of the raw probability the
grammar allowed there and the token's log probability renormalised over that set, and in total the
log probability that the model stays inside the grammar along the text.

The sums run in float64 over the float32 rows the engine returns (`prompt_logprobs: -1`), so a scored
text is bounded by the whole-vocabulary cap (--max-vocab-positions).
"""

from __future__ import annotations

import numpy as np

from ...backend import Constraint
from ...config import Limits
from ...engine.host import grammar
from ...tokens import TextAssembler
from ..errors import InvalidRequest


def check_inputs(backend, constraint: Constraint, param: str, inputs: list[list[int]]) -> list[grammar.TextCheck]:
    """Each input's tokens read under the constraint, with the allowed set at every token; a 400 at the
    first input that leaves it."""
    vocab = grammar.vocab_of_model(backend)
    try:
        grammar.grammar_for(constraint, vocab)
    except grammar.GrammarError as exc:
        raise InvalidRequest(f"Invalid value for '{param}': the constraint does not compile for this model: "
                             f"{str(exc).strip()}", param) from None
    checks = []
    for index, ids in enumerate(inputs):
        check = grammar.check_text(constraint, ids, vocab)
        if check.first_bad is not None:
            raise _leaves(backend, index, ids, check.first_bad, param)
        checks.append(check)
    return checks


def _leaves(backend, index: int, ids: list[int], bad: int, param: str) -> InvalidRequest:
    asm = TextAssembler(backend.table)
    for token in ids[:bad + 1]:
        asm.add(token)
    token = backend.table.strings[ids[bad]]
    return InvalidRequest(f"Invalid value for 'input': input {index} leaves the constraint ('{param}') at token "
                          f"{bad} ({token!r}, id {ids[bad]}), character {asm.offsets[bad]} of the input.", "input")


def check_cap(backend, token_lists: list[list[int]], has_residual: bool, limits: Limits) -> None:
    """Scoring under a constraint reads every position's whole distribution: the whole-vocabulary cap."""
    positions = sum(len(ids) for ids in token_lists)
    cap, flag = limits.vocab_positions(backend.info.vocab_size, has_residual)
    if positions > cap:
        raise InvalidRequest(f"Scoring under a constraint reads the whole vocabulary at every position, so it takes "
                             f"at most {cap} tokens, summed over the inputs with their contexts ({flag}); this "
                             f"request has {positions}. Send fewer or shorter inputs.", "input")


def block(check: grammar.TextCheck, full: np.ndarray, ids: np.ndarray, first: int) -> dict:
    """The `constraint` block of one input: `full` [P, V] are the raw rows of the whole prompt (row p
    predicts token p), `ids` the input's tokens, starting at prompt position `first`."""
    allowed_logmass, constrained = [], []
    for j, token in enumerate(ids.tolist()):
        position = first + j
        if position == 0:  # nothing predicts the first token of the text
            allowed_logmass.append(None)
            constrained.append(None)
            continue
        row = full[position].astype(np.float64)
        # float32 log probabilities can sum to a little over 1: a log probability is never above 0
        mass = min(float(np.logaddexp.reduce(row[check.masks[j]])), 0.0)
        allowed_logmass.append(mass)
        constrained.append(min(float(row[token]) - mass, 0.0))
    kept = [x for x in allowed_logmass if x is not None]
    return {"constraint_logprobs": allowed_logmass, "token_logprobs": constrained,
            "constraint_logprob": float(sum(kept)),
            "logprob": float(sum(x for x in constrained if x is not None)),
            "is_complete": bool(check.is_complete)}
