"""A token tree's passes on the device (engine/host/tree.py has the tree itself): one forward pass per level
and the children of every node it ran, chosen on the device and brought to the host in one transfer.

The lean runner runs a level as one pass over the level's nodes with a tree attention mask over keys and
values kept for the whole tree (lean/tree.py). transformers' forward (runner.ModelRunner, for models no
family of the lean runner claims) recomputes each node's whole path instead (`ModelRunner.tree_pass`).
Either way the pass is the runner's `tree_pass` (engine/contract.py).
"""

from __future__ import annotations

import numpy as np
import torch

from ...backend import SamplingParams, TreeShape
from .instruments import entropy_of, ranks_of
from .sampler import BatchSettings, filtered_scores
from .steering import Steering, conflict_at, steered_distributions
from .top_k import top_k
from ..host.tree import Children, TreeGroup

def grow_tree(runner, tree: TreeGroup, new_grammar_state=None, hit=None) -> None:
    """The tree's next level: one pass (the prompt, or the frontier's nodes) and their children recorded.
    `new_grammar_state(constraint)`: a grammar's state at the start of a text (for a constrained tree);
    `hit`: the prompt's kept prefix, for the first pass (the runner's `tree_pass`)."""
    raw = runner.tree_pass(tree, hit)
    masks = steering_masks(tree, raw.shape[-1], new_grammar_state) if tree.params.is_steered else None
    tree.grow(children_of(raw, tree.params, tree.shape, masks))


def steering_masks(tree: TreeGroup, vocab: int, new_grammar_state) -> np.ndarray | None:
    """[R, V] bool: the tokens each frontier node's path may be followed by (allowed_token_ids, bad words
    that the path would complete, the grammar after the path), or None where nothing is masked. A row
    that allows nothing stays empty: its node gets no children; at the root (the tree's first token)
    that leaves no tree at all, and it is the request's own conflict (a 400 naming the fields, as a
    completion's first token: steering.conflict_at)."""
    params, steering = tree.params, Steering(tree.params, vocab, "cpu")
    rows = []
    for node in tree.frontier:
        path = tree.path(node) if node >= 0 else []
        grammar = (None, False)
        if params.constraint is not None and new_grammar_state is not None:
            state = new_grammar_state(params.constraint)
            for token in path:
                state.advance(token)
            grammar = (state.allowed(), state.is_accepting)
        mask = steering.row_mask(path, *grammar)
        if node < 0 and mask is not None and not mask.any():
            raise conflict_at(params, 0)
        rows.append(mask)
    if all(mask is None for mask in rows):
        return None
    return np.stack([np.ones(vocab, dtype=bool) if mask is None else mask for mask in rows])


def processed_rows(raw: torch.Tensor, params: SamplingParams, masks: np.ndarray | None = None) -> torch.Tensor:
    """[R, V] float32: the log probabilities of the distribution a token would be drawn from after each
    row's raw ones ([R, V]): steering where the request has it (engine/device/steering.py: bias, `masks`), then
    temperature, top-k and top-p (the sampler's own `filtered_scores`); a greedy request's is a point mass
    on the likeliest token. A row whose mask allows nothing is -inf throughout."""
    if params.is_steered:
        empty = None if masks is None else ~masks.any(axis=1)
        if empty is not None and empty.any():
            masks = masks.copy()
            masks[empty] = True  # computed as unmasked, then emptied
        processed = steered_distributions(raw, params, masks)[0]
        if empty is not None and empty.any():
            processed[torch.from_numpy(empty).to(raw.device)] = float("-inf")
        return processed
    if params.is_greedy:
        likeliest = torch.argmax(raw, dim=-1, keepdim=True)
        return torch.full_like(raw, float("-inf")).scatter_(-1, likeliest, 0.0)
    settings = BatchSettings.of([params] * raw.shape[0], raw.shape[-1], raw.device)
    return torch.log_softmax(filtered_scores(raw, settings), dim=-1)


def children_of(raw: torch.Tensor, params: SamplingParams, shape: TreeShape, masks: np.ndarray | None = None
                ) -> Children:
    """Each row's children: the `branches` likeliest tokens of its processed distribution that may be
    drawn at all (processed > -inf), cut under `branch_p` to the fewest whose processed probability
    reaches p (the top-p rule: a token is in while the mass before it is short of p); with their raw log
    probabilities and ranks, and the raw distribution's entropy. One device-to-host copy."""
    processed = processed_rows(raw, params, masks)
    k = min(shape.branches, raw.shape[-1])
    top, ids = top_k(processed, k)  # the likeliest first (equal values: smaller id first)
    keep = top > float("-inf")
    if shape.branch_p is not None:
        probs = top.exp()
        keep &= (probs.cumsum(dim=-1) - probs) < shape.branch_p  # the first: 0 before it, always in
    values = raw.gather(1, ids)
    columns = [keep.sum(dim=-1, keepdim=True), entropy_of(raw)[:, None], ids, values, top, ranks_of(raw, values)]
    host = torch.cat([c.double() for c in columns], dim=1).cpu().numpy()  # ids and float32 exact in float64
    ids_at, values_at, top_at, ranks_at = (slice(2 + i * k, 2 + (i + 1) * k) for i in range(4))
    return Children(counts=host[:, 0].astype(np.int64), token_ids=host[:, ids_at].astype(np.int64),
                    logprobs=host[:, values_at].astype(np.float32),
                    processed_logprobs=host[:, top_at].astype(np.float32),
                    ranks=host[:, ranks_at].astype(np.int64), entropies=host[:, 1].astype(np.float32))
