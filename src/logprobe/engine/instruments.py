"""The researcher's instruments on the device: the asked token ids' log probabilities and ranks, the
entropy of each distribution, its top-p set, the actual token's rank, and the distribution a generated
token was drawn from (docs/api.md, section 2.3).

Prompt positions are reduced chunk by chunk in `fill_prompt_columns` (runner.py) by `fill_prompt_extras`;
generated positions in the engine's `_postprocess` by a group's `Instruments`. Only requests that ask
get either: a plain request's group has no `Instruments`, and its prompt columns no extras.
"""

from __future__ import annotations

import numpy as np
import torch

from ..backend import PositionColumns, SamplingParams
from .sampler import BatchSettings, sample_batch, sample_with_distribution

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


def ranks_of(lsm: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[R, K] int64: 1 + the number of entries of row r of `lsm` ([R, V]) strictly larger than values[r, k]."""
    if values.shape[1] <= FEW_IDS:
        return torch.stack([count_greater(lsm, values[:, j:j + 1]) for j in range(values.shape[1])], dim=1) + 1
    ascending = torch.sort(lsm, dim=1).values
    at_most = torch.searchsorted(ascending, values.contiguous(), right=True)  # entries <= each value
    return lsm.shape[1] - at_most + 1


def entropy_of(lsm: torch.Tensor) -> torch.Tensor:
    """[R] float32: -sum p log p in nats; a token of probability 0 adds 0 (its -inf is clamped, 0 x finite)."""
    return -(lsm.exp() * lsm.clamp(min=torch.finfo(lsm.dtype).min)).sum(dim=1)


def top_p_sets(lsm: torch.Tensor, p: float, cap: int):
    """Per row the smallest set of likeliest tokens whose probability reaches p (the rule of top_p
    sampling: a token is in when the mass before it is short of p), at most `cap` tokens:
    (ids [R, cap], log probabilities [R, cap], counts [R], masses [R], truncated [R])."""
    cap = min(cap, lsm.shape[1])
    values, ids = torch.topk(lsm, cap, dim=1)  # the likeliest first
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


def fill_prompt_extras(extras: PositionColumns, lsm: torch.Tensor, rows: slice) -> None:
    """Reduce one chunk of prompt distributions (lsm [C, V], describing positions `rows`) on the device."""
    if extras.token_ids is not None:
        ids = torch.as_tensor(extras.token_ids, device=lsm.device)
        values = lsm[:, ids]
        extras.token_id_logprobs[rows] = values.cpu().numpy()
        extras.token_id_ranks[rows] = ranks_of(lsm, values).cpu().numpy()
    if extras.entropy is not None:
        extras.entropy[rows] = entropy_of(lsm).cpu().numpy()
    if extras.top_p is not None:
        ids, values, counts, mass, truncated = top_p_sets(lsm, extras.top_p, extras.top_p_ids.shape[1])
        extras.top_p_ids[rows] = ids.cpu().numpy()
        extras.top_p_logprobs[rows] = values.cpu().numpy()
        extras.top_p_counts[rows] = counts.cpu().numpy()
        extras.top_p_mass[rows] = mass.cpu().numpy()
        extras.top_p_truncated[rows] = truncated.cpu().numpy()


class RowLog:
    """A choice's instrument rows, one per generated token (numpy rows, stacked at the end)."""

    def __init__(self):
        self.columns: dict[str, list] = {}
        self.processed_logprobs: list[float] = []
        self.processed_top_logprobs: list[np.ndarray] = []

    def add(self, name: str, value) -> None:
        self.columns.setdefault(name, []).append(value)

    def position_columns(self, params: SamplingParams, stop: int) -> PositionColumns | None:
        """The columns of the first `stop` generated tokens (those a stop string's cut kept)."""
        if not params.needs_position_columns:
            return None
        out = PositionColumns(top_p=params.top_logprobs_p)
        if params.logprob_token_ids:
            out.token_ids = np.asarray(params.logprob_token_ids, dtype=np.int64)
        for name, dtype, width in generated_columns(params):
            values = self.columns.get(name)
            if values:
                setattr(out, name, np.asarray(values, dtype=dtype)[:stop])
            else:  # nothing generated
                setattr(out, name, np.zeros((0,) if width is None else (0, width), dtype=dtype))
        return out


def generated_columns(params: SamplingParams) -> list[tuple[str, type, int | None]]:
    """(name, dtype, row width or None) of each PositionColumns column a request's generated rows have."""
    out = []
    if params.logprob_token_ids:
        num = len(params.logprob_token_ids)
        out += [("token_id_logprobs", np.float32, num), ("token_id_ranks", np.int64, num)]
        if params.records_processed:
            out.append(("token_id_logprobs_processed", np.float32, num))
    if params.position_stats:
        out += [("entropy", np.float32, None), ("ranks", np.int64, None)]
    if params.top_logprobs_p is not None:
        cap = params.max_top_p_tokens
        out += [("top_p_ids", np.int64, cap), ("top_p_logprobs", np.float32, cap), ("top_p_counts", np.int64, None),
                ("top_p_mass", np.float32, None), ("top_p_truncated", bool, None)]
    return out


class Instruments:
    """A group's generated-position instruments: what its request asked, computed each step for the
    group's rows before and while its tokens are sampled."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.ids: torch.Tensor | None = None
        self.batch: dict[str, np.ndarray] = {}
        self.tokens: list[int] = []
        self.processed: torch.Tensor | None = None

    @classmethod
    def of(cls, params: SamplingParams) -> "Instruments | None":
        return cls(params) if params.needs_position_columns or params.records_processed else None

    def before_sampling(self, lsm: torch.Tensor, seqs: list) -> None:
        """What does not depend on the sampled tokens, for every row at once, and the rows' tokens (drawn
        as `sample_batch` draws them, with the distribution they were drawn from where it is asked)."""
        params, batch = self.params, {}
        if params.logprob_token_ids:
            if self.ids is None or self.ids.device != lsm.device:
                self.ids = torch.as_tensor(params.logprob_token_ids, dtype=torch.long, device=lsm.device)
            values = lsm[:, self.ids]
            batch["token_id_logprobs"] = values.cpu().numpy()
            batch["token_id_ranks"] = ranks_of(lsm, values).cpu().numpy()
        if params.position_stats:
            batch["entropy"] = entropy_of(lsm).cpu().numpy()
        if params.top_logprobs_p is not None:
            cap = min(params.max_top_p_tokens, lsm.shape[1])
            sets = top_p_sets(lsm, params.top_logprobs_p, cap)
            for name, value in zip(("top_p_ids", "top_p_logprobs", "top_p_counts", "top_p_mass", "top_p_truncated"),
                                   sets):
                batch[name] = value.cpu().numpy()
        settings = BatchSettings.of([params] * len(seqs), lsm.shape[1], lsm.device,
                                    [s.next_seed() for s in seqs])
        if params.records_processed:
            tokens, self.processed = sample_with_distribution(lsm, settings)
        else:
            tokens, self.processed = sample_batch(lsm, settings), None
        self.tokens = tokens.tolist()
        self.batch = batch

    def sample(self, seq, lsm: torch.Tensor, row: int, top_ids: np.ndarray | None,
               top_values: np.ndarray | None) -> int:
        """Record row `row`'s token (drawn in `before_sampling`), its log probabilities and instrument
        rows on `seq`."""
        params = self.params
        raw = lsm[row]
        if seq.rows is None:
            seq.rows = RowLog()
        log = seq.rows
        token = self.tokens[row]
        processed = None if self.processed is None else self.processed[row]
        raw_value = float(raw[token])
        if processed is not None:
            processed_value = float(processed[token])
            processed_top = processed[torch.as_tensor(top_ids)].cpu().numpy() if top_ids is not None else None
            if params.logprob_token_ids:
                log.add("token_id_logprobs_processed", processed[self.ids].cpu().numpy())
        seq.token_ids.append(token)
        if params.logprobs_mode == "processed" and processed is not None:
            seq.logprobs.append(processed_value)
            if top_ids is not None:
                seq.top_ids.append(top_ids)
                seq.top_logprobs.append(processed_top)
        else:
            seq.logprobs.append(raw_value)
            if top_ids is not None:
                seq.top_ids.append(top_ids)
                seq.top_logprobs.append(top_values)
            if processed is not None:  # "both"
                log.processed_logprobs.append(processed_value)
                if top_ids is not None:
                    log.processed_top_logprobs.append(processed_top)
        for name, values in self.batch.items():
            log.add(name, values[row])
        if params.position_stats:
            log.add("ranks", int((raw > raw[token]).sum()) + 1)
        return token
