"""A token tree's passes on the lean runner (engine/host/tree.py): the prompt once, then each level of the tree
as one pass over its nodes, like the tree verification of speculative decoding.

The prompt starts after its longest prefix the prefix cache keeps (prefix_cache.py; the engine finds it
in its prefix index before the tree's first pass), and leaves its whole blocks there. The tree's keys and values live in one buffer per layer, `TreeKV` ([KV, P + inner nodes, d]): the
prompt's positions, then each expanded node's, in the order the passes ran them. A level's pass writes
its nodes' keys and values after the ones held (attention.ChunkKV, as a prompt chunk does) and attends
over the buffer with a tree mask: each node sees the prompt, its ancestors and itself, at its true
position (a node of depth L sits at position P + L - 1); sliding windows cut the same mask by position.
"""

from __future__ import annotations

import numpy as np
import torch

from ....backend import TreeShape
from ...host.tree import TreeGroup
from ...host.prefix_index import Hit
from ..prefix_cache import views
from .attention import ChunkKV, PassMeta
from .prefill import prepare_prefill


class TreeKV:
    """A tree's keys and values (per layer [KV, capacity, d]: the prompt, then the expanded nodes), the
    position of each column, and the column of each expanded node."""

    def __init__(self, runner, num_prompt: int, capacity: int):
        shape = (runner.kv_heads, capacity, runner.head_dim)
        self.keys = [torch.zeros(shape, dtype=runner.dtype, device=runner.device) for _ in runner.layers]
        self.values = [torch.zeros(shape, dtype=runner.dtype, device=runner.device) for _ in runner.layers]
        self.positions = np.zeros(capacity, dtype=np.int64)
        self.positions[:num_prompt] = np.arange(num_prompt)
        self.column_of: dict[int, int] = {}
        self.num_prompt = num_prompt
        self.length = 0  # columns written


def inner_nodes(shape: TreeShape) -> int:
    """The most nodes a tree of this shape expands (those above its deepest level)."""
    return TreeShape(shape.depth - 1, shape.branches).max_nodes


def tree_pass(runner, tree: TreeGroup, hit: Hit | None = None) -> torch.Tensor:
    """The tree's next pass: the prompt (first; after `hit`, its longest kept prefix, where the engine
    found one) or its frontier's nodes, one row each. Returns their raw next-token log probabilities
    [rows, V]."""
    record = runner.record(tree)
    if record.tree is None:
        num_prompt = tree.num_prompt_tokens
        state = record.tree = TreeKV(runner, num_prompt, num_prompt + inner_nodes(tree.shape))
        # the prompt after its longest kept prefix, whose keys and values are copied in
        cache, start = runner.prefix_cache, 0
        if hit is not None:
            start, keys, values, _ = views(hit)
            for layer in range(len(runner.layers)):
                state.keys[layer][:, :start] = keys[layer]
                state.values[layer][:, :start] = values[layer]
        ids = torch.tensor([tree.prompt_ids[start:]], dtype=torch.long, device=runner.device)
        hidden = runner.forward(ids, prepare_prefill(runner, [(state, start, num_prompt)]))[0, -1:]
        state.length = num_prompt
        if not cache.covers(tree.prompt_ids):  # the prompt's whole blocks, for what comes after it
            cache.insert(tree.prompt_ids, [k[:, :num_prompt] for k in state.keys],
                         [v[:, :num_prompt] for v in state.values], None)
        return runner.logprobs_of(hidden)
    state, frontier = record.tree, tree.frontier
    start, stop = state.length, state.length + len(frontier)
    position = state.num_prompt + tree.level - 1
    for j, node in enumerate(frontier):
        state.column_of[node] = start + j
    state.positions[start:stop] = position
    ids = torch.tensor([[tree.token_ids[node] for node in frontier]], dtype=torch.long, device=runner.device)
    hidden = runner.forward(ids, prepare_tree(runner, tree, state, start, stop))[0]
    state.length = stop
    return runner.logprobs_of(hidden)


def prepare_tree(runner, tree: TreeGroup, state: TreeKV, start: int, stop: int) -> PassMeta:
    """The pass of the frontier's nodes (columns start..stop of the buffer): each query sees the prompt's
    columns and those of its lineage (its ancestors and itself)."""
    seen = np.zeros((stop - start, stop), dtype=bool)
    seen[:, :state.num_prompt] = True
    for row, node in enumerate(tree.frontier):
        seen[row, [state.column_of[n] for n in tree.lineage(node)]] = True
    device = runner.device
    key_positions = torch.from_numpy(state.positions[:stop]).to(device)
    query_positions = key_positions[start:stop]
    read = runner.attention.aligned(stop)  # the columns read (Attention.aligned), those past the tree's masked
    seen = np.pad(seen, ((0, 0), (0, read - stop)))
    key_positions = torch.cat([key_positions, key_positions.new_zeros(read - stop)])
    masks = runner.attention.row_masks(torch.from_numpy(seen).to(device)[None], query_positions[None, :, None],
                                       key_positions[None, None, :])
    return PassMeta(query_positions[None], {w: [mask] for w, mask in masks.items()},
                    kv=ChunkKV([(state, start, stop)], [read]))
