"""/v1/score's `logprob_token_ids`: the same ids at every scored position, or each position's own ids (a
distilled student's top-k at each position of its text, read in the teacher). The engine computes the asked
ids' log probabilities and ranks chunk by chunk on the device, as for the same ids everywhere
(engine/device/instruments.py: one gather per chunk of positions), so no vocabulary row leaves it."""

from __future__ import annotations

from dataclasses import replace

from ...backend import PositionColumns, SamplingParams
from ...output.logprobs import wire_floats
from ..checks.vocabulary import check_token_ids
from ..errors import InvalidRequest


def check(backend, asked, items) -> None:
    """Every id in the vocabulary; per position, one list for each scored token of each entry."""
    lists = [asked] if isinstance(asked, tuple) else [ids for entry in asked for ids in entry]
    check_token_ids((t for ids in lists for t in ids), backend.info.vocab_size, "logprob_token_ids")
    if isinstance(asked, tuple):
        return
    for index, (entry, item) in enumerate(zip(asked, items)):
        # one list per entry of the answer's `tokens`: with a BOS that is num_tokens; without one the
        # first token is in `tokens` (its numbers null: nothing predicts it), so one more
        count = len(item.token_ids) - item.first
        if len(entry) != count:
            first = (f" (num_tokens {count - 1}, and the first token, which nothing predicts: its list is "
                     "read nowhere)" if item.first == 0 else "")
            raise InvalidRequest(f"Invalid value for 'logprob_token_ids': entry {index} has {count} tokens{first}, "
                                 f"and its list has {len(entry)} position lists; send one list of ids per token "
                                 "of the entry's 'tokens'.", "logprob_token_ids")


def params_of(asked, items, params: SamplingParams) -> list[SamplingParams]:
    """Each entry's SamplingParams: the same ids everywhere, or its own per prompt position (none asked at
    the tokens before the scored ones)."""
    if isinstance(asked, tuple):
        return [replace(params, logprob_token_ids=asked)] * len(items)
    return [replace(params, position_token_ids=((),) * item.first + tuple(mine)) for item, mine in zip(items, asked)]


def block(req, index: int, extras: PositionColumns, scored: slice, first_is_null: bool) -> dict:
    """Entry `index`'s `logprob_token_ids`: {"token_ids", "logprobs", "ranks"}, a list per scored token (null
    at a first token nothing predicts); `token_ids` as asked (one list, or one per position)."""
    per_position = not isinstance(req.logprob_token_ids, tuple)
    asked = req.logprob_token_ids[index] if per_position else req.logprob_token_ids
    values = wire_floats(extras.token_id_logprobs[scored]).tolist()
    ranks = extras.token_id_ranks[scored].tolist()
    if per_position:  # rows padded to the widest position: each keeps its own count
        counts = [len(ids) for ids in asked]
        values = [row[:n] for row, n in zip(values, counts)]
        ranks = [row[:n] for row, n in zip(ranks, counts)]
    if first_is_null and values:
        values[0] = ranks[0] = None
    ids = [list(p) for p in asked] if per_position else list(asked)
    return {"token_ids": ids, "logprobs": values, "ranks": ranks}

