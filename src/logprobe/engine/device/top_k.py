"""The k likeliest entries of each row, in one order whatever the call holds: by value, largest first,
and among equal values the smaller token id first (the smaller ids are also the ones kept where equal
values straddle the k-th place).

`torch.topk` alone leaves equal values in an order of its own, which on a CPU moves with the number of
rows in the call: a row's `top_logprobs` ids then depended on what decoded beside it (seen in bfloat16,
where ties among 49,152 log probabilities are common; float32 rows can tie too, wherever two logits
are equal). So the call asks `torch.topk` for 8 more than k and orders those by value and then id; only
a row whose last one still equals the k-th value (more than 8 ties there) is ordered from all of its
entries at least the k-th value (`_settled_from`). On a GPU and inside torch.compile, where a branch on
the data would cost a transfer or cannot run, the order is made with fixed shapes (`_settled`: top-ks
over the entries above and equal to the k-th value, and a sort of the k)."""

from __future__ import annotations

import torch

EXTRA = 8  # entries asked of torch.topk past the k: equal values at the k-th place are mostly among them


def top_k(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids), each [..., k], of the k largest entries of each row of `rows` ([..., V]): largest
    first, equal values by ascending id, the smallest ids kept of those equal to the k-th value."""
    vocab = rows.shape[-1]
    if k == 0 or not reads_on_host(rows):
        values, ids = torch.topk(rows, k, dim=-1)
        return (values, ids) if k == 0 else _settled(rows, values, k)
    flat = rows.reshape(-1, vocab)
    more, more_ids = torch.topk(flat, min(k + EXTRA, vocab), dim=-1)
    # every entry equal to the k-th value is among these where the last of them is below it: then the
    # k are the first of these by value and then id (sorted by id, then stably by value)
    by_id = torch.sort(more_ids, dim=-1).indices
    more, more_ids = more.gather(-1, by_id), more_ids.gather(-1, by_id)
    by_value = torch.sort(more, dim=-1, descending=True, stable=True).indices[:, :k]
    values, ids = more.gather(-1, by_value), more_ids.gather(-1, by_value)
    if k + EXTRA < vocab and bool((overflow := more.min(dim=-1).values == values[:, -1]).any()):
        # entries equal to the k-th value may lie past the k + EXTRA: those rows' order from the whole rows
        which = overflow.nonzero()[:, 0]
        sub = flat[which]
        candidates = sub >= values[which, k - 1:]
        values[which], ids[which] = _settled_from(sub, candidates, candidates.sum(dim=-1), k)
    return values.reshape(*rows.shape[:-1], k), ids.reshape(*rows.shape[:-1], k)


def _settled_from(rows: torch.Tensor, candidates: torch.Tensor, counts: torch.Tensor, k: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`top_k`'s order for rows [R, V] made from their candidates (a mask of the entries at least the k-th
    value: few), taken in ascending id order, sorted by value with a stable sort, the first k kept."""
    where = candidates.nonzero()  # (row, id), by row and then ascending id
    values = rows[where[:, 0], where[:, 1]]
    order = torch.sort(values, descending=True, stable=True).indices  # equal values keep ascending ids
    order = order[torch.sort(where[order, 0], stable=True).indices]  # by row again, each row's order kept
    starts = torch.cumsum(counts, 0) - counts
    take = order[(starts[:, None] + torch.arange(k, device=rows.device)).reshape(-1)]
    return values[take].reshape(-1, k), where[take, 1].reshape(-1, k)


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

    # (a Python scalar, not a tensor made from one: that would copy to a GPU, which a CUDA graph's capture refuses)
    def smallest_ids(where: torch.Tensor) -> torch.Tensor:  # the k smallest ids where `where` holds, ascending
        found = torch.topk(torch.where(where, -positions, float("-inf")), k, dim=-1).values.neg()
        return found.clamp(max=vocab - 1).long()  # (past the matches: +inf, never read)

    above_ids, tied_ids = smallest_ids(rows > kth), smallest_ids(rows == kth)
    place = torch.arange(k, device=rows.device)
    ids = torch.where(place < above, above_ids, tied_ids.gather(-1, (place - above).clamp(min=0)))
    chosen = rows.gather(-1, ids)
    # sort the k by value, largest first; a stable sort keeps the ascending ids of equal values
    order = torch.sort(chosen, dim=-1, descending=True, stable=True).indices
    return chosen.gather(-1, order), ids.gather(-1, order)
