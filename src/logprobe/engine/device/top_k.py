"""The k likeliest entries of each row, in one order whatever the call holds: by value, largest first,
and among equal values the smaller token id first (the smaller ids are also the ones kept where equal
values straddle the k-th place).

`torch.topk` alone leaves equal values in an order of its own, which on a CPU moves with the number of
rows in the call: a row's `top_logprobs` ids then depended on what decoded beside it (seen in bfloat16,
where ties among 49,152 log probabilities are common; float32 rows can tie too, wherever two logits
are equal). Ties are rare in float32, so the common call is `torch.topk` plus one pass that finds the
rows it could have ordered otherwise; only then is the order made (`_settled`: top-ks over the entries
above and equal to the k-th value, and a sort of the k). On a GPU and inside torch.compile, where a
branch on the data would cost a transfer or cannot run, the order is always made."""

from __future__ import annotations

import torch


def top_k(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids), each [..., k], of the k largest entries of each row of `rows` ([..., V]): largest
    first, equal values by ascending id, the smallest ids kept of those equal to the k-th value."""
    values, ids = torch.topk(rows, k, dim=-1)
    if k == 0:
        return values, ids
    if not reads_on_host(rows):
        return _settled(rows, values, k)
    kth = values[..., -1:]
    tied = ((rows >= kth).sum(dim=-1) > k) | (values[..., 1:] == values[..., :-1]).any(dim=-1)
    if not bool(tied.any()):
        return values, ids
    return _settled(rows, values, k)


def reads_on_host(rows: torch.Tensor) -> bool:
    """Whether `top_k` may branch on whether a call's rows tie (a read of the device's data): on a CPU,
    where that read costs nothing, outside torch.compile. On a GPU the order is always made, so that a
    decode step keeps its one transfer to the host (tests/model/test_host_transfers.py)."""
    return rows.device.type == "cpu" and not torch.compiler.is_compiling()


def _settled(rows: torch.Tensor, values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The order of `top_k`, made from the k largest values (`values`, which equal values cannot change):
    the entries above the k-th value, then the smallest ids equal to it, sorted by value and then id."""
    vocab = rows.shape[-1]
    kth = values[..., -1:]
    above = (values > kth).sum(dim=-1, keepdim=True)  # entries strictly above the k-th value: all kept
    positions = torch.arange(vocab, device=rows.device, dtype=torch.float32)  # ids below 2**24: exact
    never = torch.tensor(float("-inf"), device=rows.device)

    def smallest_ids(where: torch.Tensor) -> torch.Tensor:  # the k smallest ids where `where` holds, ascending
        found = torch.topk(torch.where(where, -positions, never), k, dim=-1).values.neg()
        return found.clamp(max=vocab - 1).long()  # (past the matches: +inf, never read)

    above_ids, tied_ids = smallest_ids(rows > kth), smallest_ids(rows == kth)
    place = torch.arange(k, device=rows.device)
    ids = torch.where(place < above, above_ids, tied_ids.gather(-1, (place - above).clamp(min=0)))
    chosen = rows.gather(-1, ids)
    # sort the k by value, largest first; a stable sort keeps the ascending ids of equal values
    order = torch.sort(chosen, dim=-1, descending=True, stable=True).indices
    return chosen.gather(-1, order), ids.gather(-1, order)
