"""What a step chose for a group's rows, as a named record of numpy columns, and the plain groups' pick.

The device side makes a `Pick` per group in one of two ways: for plain requests, `pick_plain_groups`
picks every plain group's rows on the device at once and `split_picks` cuts the one array the step
brings to the host (`sampler.pick`'s, or the runner's when it picked in its recorded pass); for a
request that asked for instruments or steers its draw, `instruments.pick_with_instruments` builds it
with their columns. The output processor (output_processor.py) records it on the group's sequences the
same way in both cases, and so does the engine's test double (tests/fake_backend.py). No torch at import
(the host side imports this module without it); `pick_plain_groups` imports it when called.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from .request import SequenceGroup

# The columns of sampler.pick's host array ([rows, 2 + 2k] float64: ids and float32 values are exact):
TOKEN, LOGPROB, TOP = 0, 1, 2  # the token, its log probability, then k top ids and k top log probabilities


@dataclass
class Pick:
    """One group's active rows after a step, row r for the sequence `group.active_rows[r]`."""

    tokens: np.ndarray  # [R] int64: the token each row chose
    logprobs: np.ndarray  # [R] float32: its log probability (raw, or processed where the request asked)
    top_ids: np.ndarray  # [R, k] int64: the k likeliest tokens, k the request's `logprobs` (0: none)
    top_logprobs: np.ndarray  # [R, k] float32: their log probabilities (as `logprobs`)
    processed_logprobs: np.ndarray | None = None  # [R] logprobs_mode "both": the drawn-from distribution's
    processed_top_logprobs: np.ndarray | None = None  # [R, k] ... and its values at `top_ids`
    columns: dict[str, np.ndarray] = field(default_factory=dict)  # instrument columns, [R, ...] each
    processed_top_ids: np.ndarray | None = None  # [R, k] "both", steered: the processed distribution's own top-k
    constraint_logprobs: np.ndarray | None = None  # [R] a masked request: log of the raw mass allowed

    @property
    def num_rows(self) -> int:
        return len(self.tokens)


def split_picks(host: np.ndarray, num_rows: list[int], widths: list[int], k: int) -> list[Pick]:
    """`host` ([sum(num_rows), 2 + 2k], sampler.pick's layout) cut into one Pick per group: group i has
    the next `num_rows[i]` rows and keeps `widths[i]` (<= k) of the top-k."""
    picks, start = [], 0
    for count, width in zip(num_rows, widths):
        rows = host[start:start + count]
        start += count
        picks.append(Pick(tokens=rows[:, TOKEN].astype(np.int64), logprobs=rows[:, LOGPROB].astype(np.float32),
                          top_ids=rows[:, TOP:TOP + width].astype(np.int64),
                          top_logprobs=rows[:, TOP + k:TOP + k + width].astype(np.float32)))
    return picks


def pick_plain_groups(groups: list[SequenceGroup], logprob_rows: list[torch.Tensor]) -> list[Pick | None]:
    """The tokens of every active row of the plain groups (those whose request asked for no
    instrument) with their log probabilities and top-k, computed for all of them at once on the
    device and brought to the host in one transfer. None for the other groups."""
    import torch  # here, not at the top: the host side imports this module without torch

    from ..device.sampler import BatchSettings, pick as pick_on_device

    plain = [i for i, g in enumerate(groups) if not g.picks_alone and g.active_rows]
    if not plain:
        return [None] * len(groups)
    rows = logprob_rows[plain[0]] if len(plain) == 1 else torch.cat([logprob_rows[i] for i in plain])
    seqs = [groups[i].sequences[j] for i in plain for j in groups[i].active_rows]
    params = [groups[i].params for i in plain for _ in groups[i].active_rows]
    seeds = None if all(p.is_greedy for p in params) else [s.next_seed() for s in seqs]
    k = max(groups[i].params.logprobs or 0 for i in plain)
    settings = BatchSettings.of(params, rows.shape[-1], rows.device, seeds)
    host = pick_on_device(rows, settings, k).cpu().numpy()  # the step's one transfer
    return split_plain_picks(groups, plain, host, k)


def split_plain_picks(groups: list[SequenceGroup], plain: list[int], host: np.ndarray, k: int) -> list[Pick | None]:
    """The host array of the active rows of `groups[i]` for i in `plain` (in that order) as a Pick per
    group, None for the others."""
    picks: list[Pick | None] = [None] * len(groups)
    split = split_picks(host, [len(groups[i].active_rows) for i in plain],
                        [groups[i].params.logprobs or 0 for i in plain], k)
    for i, pick in zip(plain, split):
        picks[i] = pick
    return picks
