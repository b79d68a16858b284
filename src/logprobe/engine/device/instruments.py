"""The researcher's instruments on the device: the asked token ids' log probabilities and ranks, the
entropy of each distribution, its top-p set, the actual token's rank, and the distribution a generated
token was drawn from (docs/api.md, section 2.3).

Prompt positions are reduced chunk by chunk in `PromptColumnWriter.fill` (prompt_columns.py) by
`fill_prompt_extras`; generated positions, with the tokens, by `pick_with_instruments`, which hands the
output processor a `Pick` with these columns; it also picks a steered request's rows (logit_bias,
allowed_token_ids, bad words, a grammar: steering.py). Only requests that ask get either: a plain
request's group is picked by `sampler.pick` (picks.pick_plain_groups), and its prompt columns have no extras.
"""

from __future__ import annotations

import numpy as np
import torch

from ...backend import PositionColumns, SamplingParams
from ..host.picks import Pick
from .sampler import BatchSettings, sample_batch, sample_with_distribution
from .steering import Steering, allowed_logmass, on_device
from .top_k import top_k

FEW_IDS = 16  # ranks by one comparison pass per id up to here, by one sort per row beyond (measured on 256
# rows of 49,152: one pass 0.024 s, one sort 0.44 s)


_BYTES_OF_16 = 0x00FF00FF00FF00FF
_HALVES_OF_32 = 0x0000FFFF0000FFFF


def count_greater(rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[R] int64: how many entries of each row of `rows` ([R, V]) are strictly larger than values[r]
    ([R, 1]). The comparison's bytes (0 or 1) are added 8 at a time in int64 lanes (two steps of adding
    neighbours, then one sum per row): exact, and ~5x faster here than summing the bools (a [48, 262144]
    row block: 6.8 ms against 35 ms), which dominated scoring on a 262,144-token vocabulary."""
    above = rows > values
    if above.shape[-1] % 8 or not above.is_contiguous() or above.device.type != "cpu":
        return above.sum(dim=-1)
    x = above.view(torch.int64)  # 8 bytes of 0 or 1 per lane: never negative
    x = (x & _BYTES_OF_16) + ((x >> 8) & _BYTES_OF_16)  # 4 sums of 2 bytes, 16 bits each
    x = (x & _HALVES_OF_32) + ((x >> 16) & _HALVES_OF_32)  # 2 sums of 4, 32 bits each
    total = x.sum(dim=-1)  # each 32-bit half holds at most V / 2: no carry between them
    return (total & 0xFFFFFFFF) + (total >> 32)


def ranks_of(logprob_rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[R, K] int64: 1 + the number of entries of row r of `logprob_rows` ([R, V]) strictly larger than values[r, k]."""
    if values.shape[1] <= FEW_IDS:
        return torch.stack([count_greater(logprob_rows, values[:, j:j + 1]) for j in range(values.shape[1])], dim=1) + 1
    ascending = torch.sort(logprob_rows, dim=1).values
    at_most = torch.searchsorted(ascending, values.contiguous(), right=True)  # entries <= each value
    return logprob_rows.shape[1] - at_most + 1


ENTROPY_ROWS = 32  # rows summed at once in float64: 32 x 128,256 x 8 bytes = 33 MB at most


def entropy_of(logprob_rows: torch.Tensor) -> torch.Tensor:
    """[R] float32: -sum p log p in nats; a token of probability 0 adds 0 (its -inf is clamped, 0 x finite).

    The sum runs in one fixed order, as a float64 running sum (`cumsum`): torch's `sum` over a whole
    vocabulary splits it between its threads, so one thread and two gave entropies 1 ulp apart, and a
    replica of one thread answered otherwise than one process of two (docs/cluster.md)."""
    terms = logprob_rows.exp() * logprob_rows.clamp(min=torch.finfo(logprob_rows.dtype).min)
    out = torch.empty(terms.shape[0], dtype=logprob_rows.dtype, device=logprob_rows.device)
    for start in range(0, terms.shape[0], ENTROPY_ROWS):
        block = terms[start:start + ENTROPY_ROWS].double()
        out[start:start + ENTROPY_ROWS] = -block.cumsum(dim=1)[:, -1]
    return out


def top_p_sets(logprob_rows: torch.Tensor, p: float, cap: int):
    """Per row the smallest set of likeliest tokens whose probability reaches p (the rule of top_p
    sampling: a token is in when the mass before it is short of p), at most `cap` tokens:
    (ids [R, cap], log probabilities [R, cap], counts [R], masses [R], truncated [R])."""
    cap = min(cap, logprob_rows.shape[1])
    values, ids = top_k(logprob_rows, cap)  # the likeliest first (equal values: smaller id first)
    probs = values.exp()
    total = probs.cumsum(dim=1)
    counts = ((total - probs) < p).sum(dim=1).clamp(min=1)
    mass = total.gather(1, (counts - 1)[:, None])[:, 0]
    return ids, values, counts, mass, mass < p


def new_prompt_extras(num: int, params: SamplingParams, vocab: int) -> PositionColumns | None:
    """Empty prompt-position columns for what the request asked (None for a plain request)."""
    if not params.needs_position_columns:
        return None
    extras = PositionColumns()
    if params.logprob_token_ids:
        num_ids = len(params.logprob_token_ids)
        extras.token_ids = np.asarray(params.logprob_token_ids, dtype=np.int64)
        extras.token_id_logprobs = np.full((num, num_ids), np.nan, dtype=np.float32)
        extras.token_id_ranks = np.zeros((num, num_ids), dtype=np.int64)
    elif params.position_token_ids:
        extras.position_ids = position_id_matrix(params.position_token_ids, num)
        extras.token_id_logprobs = np.full(extras.position_ids.shape, np.nan, dtype=np.float32)
        extras.token_id_ranks = np.zeros(extras.position_ids.shape, dtype=np.int64)
    if params.position_stats:
        extras.entropy = np.full(num, np.nan, dtype=np.float32)
    if params.top_logprobs_p is not None:
        cap = min(params.max_top_p_tokens, vocab)
        extras.top_p = params.top_logprobs_p
        extras.top_p_ids = np.zeros((num, cap), dtype=np.int64)
        extras.top_p_logprobs = np.full((num, cap), np.nan, dtype=np.float32)
        extras.top_p_counts = np.zeros(num, dtype=np.int64)
        extras.top_p_mass = np.full(num, np.nan, dtype=np.float32)
        extras.top_p_truncated = np.zeros(num, dtype=bool)
    return extras


def position_id_matrix(per_position: tuple[tuple[int, ...], ...], num: int) -> np.ndarray:
    """[num, widest list] int64: row i holds prompt position i's asked ids, padded with id 0 (its numbers are
    computed and never reported: the API reads each row's own count)."""
    width = max(1, max((len(ids) for ids in per_position), default=0))
    out = np.zeros((num, width), dtype=np.int64)
    for i, ids in enumerate(per_position[:num]):
        out[i, :len(ids)] = ids
    return out


def fill_prompt_extras(extras: PositionColumns, logprob_rows: torch.Tensor, rows: slice) -> None:
    """Reduce one chunk of prompt distributions (logprob_rows [C, V], describing positions `rows`) on the device."""
    if extras.token_ids is not None or extras.position_ids is not None:
        if extras.position_ids is not None:  # each row its own ids: one gather
            ids = torch.as_tensor(extras.position_ids[rows], device=logprob_rows.device)
            values = logprob_rows.gather(1, ids)
        else:
            ids = torch.as_tensor(extras.token_ids, device=logprob_rows.device)
            values = logprob_rows[:, ids]
        extras.token_id_logprobs[rows] = values.cpu().numpy()
        extras.token_id_ranks[rows] = ranks_of(logprob_rows, values).cpu().numpy()
    if extras.entropy is not None:
        extras.entropy[rows] = entropy_of(logprob_rows).cpu().numpy()
    if extras.top_p is not None:
        ids, values, counts, mass, truncated = top_p_sets(logprob_rows, extras.top_p, extras.top_p_ids.shape[1])
        extras.top_p_ids[rows] = ids.cpu().numpy()
        extras.top_p_logprobs[rows] = values.cpu().numpy()
        extras.top_p_counts[rows] = counts.cpu().numpy()
        extras.top_p_mass[rows] = mass.cpu().numpy()
        extras.top_p_truncated[rows] = truncated.cpu().numpy()


def pick_with_instruments(logprob_rows: torch.Tensor, params: SamplingParams, seeds: list[int], k: int,
                          steering: Steering | None = None, masks: np.ndarray | torch.Tensor | None = None,
                          kept: np.ndarray | None = None) -> Pick:
    """The tokens of one group's rows (logprob_rows [R, V] raw log probabilities), drawn as `sample_batch`
    draws them (with the distribution they were drawn from where the request asks), with their log
    probabilities, top-k and the instrument columns the request asked for; brought to the host once
    per column, not per row. A steered request (`steering`, with the rows' `masks`, steering.py) is
    drawn from its biased and masked scores; its processed distribution has its own top-k, and a
    masked one the allowed log mass at each row (over `kept`, where a grammar's draw is narrower than
    what it keeps: steering.steering_of)."""
    num_rows, vocab = logprob_rows.shape
    columns = instrument_columns(logprob_rows, params)
    settings = BatchSettings.of([params] * num_rows, vocab, logprob_rows.device, seeds)
    narrower = kept is not None and kept is not masks
    if masks is not None:  # one copy to the device for the draw and the allowed mass
        masks = on_device(masks, logprob_rows.device)
    scores = logprob_rows if steering is None else steering.scores(logprob_rows, masks)
    if params.records_processed:
        tokens, processed = sample_with_distribution(scores, settings)
    else:
        tokens, processed = sample_batch(scores, settings), None
    raw = logprob_rows.gather(1, tokens[:, None])[:, 0]
    if k:
        top_values, top_ids = top_k(logprob_rows, k)
    else:
        top_values = logprob_rows.new_zeros((num_rows, 0))
        top_ids = torch.zeros((num_rows, 0), dtype=torch.long, device=logprob_rows.device)
    if params.position_stats:  # the drawn token's rank
        columns["ranks"] = count_greater(logprob_rows, raw[:, None]) + 1
    out = dict(tokens=tokens, logprobs=raw, top_ids=top_ids, top_logprobs=top_values)
    if params.is_masked and params.logprobs is not None:
        out["constraint_logprobs"] = allowed_logmass(logprob_rows, kept if narrower else masks)
    if processed is not None:
        out.update(processed_columns(processed, tokens, top_ids, params, k, steering is not None))
        if params.logprob_token_ids:
            ids = torch.as_tensor(params.logprob_token_ids, dtype=torch.long, device=logprob_rows.device)
            columns["token_id_logprobs_processed"] = processed[:, ids]
    host = {name: value.cpu().numpy() for name, value in out.items()}
    return Pick(**host, columns={name: value.cpu().numpy() for name, value in columns.items()})


def processed_columns(processed: torch.Tensor, tokens: torch.Tensor, top_ids: torch.Tensor, params: SamplingParams,
                      k: int, own_top: bool) -> dict[str, torch.Tensor]:
    """The Pick columns of the processed distribution ([R, V]): the drawn tokens' log probabilities and a
    top-k, in place of the raw ones ("processed") or beside them ("both"). Unsteered, the top-k is
    the raw top-k's ids (temperature, top-k and top-p keep the raw order); steered (`own_top`), the
    processed distribution's own k likeliest, which bias and masks reorder."""
    chosen = processed.gather(1, tokens[:, None])[:, 0]
    if own_top and k:
        chosen_top, ids = top_k(processed, k)
    else:
        chosen_top, ids = processed.gather(1, top_ids), None
    if params.logprobs_mode == "processed":
        return dict(logprobs=chosen, top_logprobs=chosen_top, **({} if ids is None else {"top_ids": ids}))
    out = dict(processed_logprobs=chosen, processed_top_logprobs=chosen_top)  # "both"
    if own_top:
        out["processed_top_ids"] = top_ids if ids is None else ids
    return out


def instrument_columns(logprob_rows: torch.Tensor, params: SamplingParams) -> dict[str, torch.Tensor]:
    """The asked ids' log probabilities and ranks, the entropy and the top-p sets of raw rows ([R, V])."""
    columns: dict[str, torch.Tensor] = {}
    if params.logprob_token_ids:
        ids = torch.as_tensor(params.logprob_token_ids, dtype=torch.long, device=logprob_rows.device)
        values = logprob_rows[:, ids]
        columns["token_id_logprobs"] = values
        columns["token_id_ranks"] = ranks_of(logprob_rows, values)
    if params.position_stats:
        columns["entropy"] = entropy_of(logprob_rows)
    if params.top_logprobs_p is not None:
        sets = top_p_sets(logprob_rows, params.top_logprobs_p, min(params.max_top_p_tokens, logprob_rows.shape[1]))
        columns.update(zip(("top_p_ids", "top_p_logprobs", "top_p_counts", "top_p_mass", "top_p_truncated"), sets))
    return columns
