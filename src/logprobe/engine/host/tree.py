"""A token tree in the engine (POST /v1/tree): a request that expands the likeliest children of each node
below its prompt, level by level, instead of generating choices. No torch here: the engine and its test
double (tests/fake_backend.py) grow the same `TreeGroup` from the same `Children` records.

The tree grows one level per engine step (engine/core.py runs a step's trees after its other work): the
first pass runs the prompt, each later pass runs every node of the newest level at once, each node
attending to the prompt's keys and values and to its own ancestors' (engine/device/tree_passes.py; on the lean
runner a tree attention mask over keys and values kept for the whole tree, lean/tree.py). So the prompt is
computed once and each expanded node once: a tree of N nodes runs P + (its expanded nodes) tokens, where
asking for each node's children with its own request runs P + depth tokens per inner node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...backend import GenerationOutput, GenerationRequest, SamplingParams, TokenTree, TreeShape
from ...tokens import TokenTable
from .request import SequenceGroup


@dataclass
class Children:
    """What one pass found below each node it ran, on the host: row r describes the r-th node of the
    tree's frontier (its children, the likeliest in the processed distribution first)."""

    counts: np.ndarray  # [R] int64: children kept (branches, fewer under branch_p or where fewer tokens may be drawn)
    token_ids: np.ndarray  # [R, K] int64
    logprobs: np.ndarray  # [R, K] float32, raw
    processed_logprobs: np.ndarray  # [R, K] float32
    ranks: np.ndarray  # [R, K] int64, in the raw distribution
    entropies: np.ndarray  # [R] float32, of the raw distribution


class TreeGroup(SequenceGroup):
    """A tree request while it runs: its nodes as growing columns (breadth first) and its frontier, the
    nodes whose children the next pass computes (-1 stands for the prompt)."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, table: TokenTable,
                 shape: TreeShape):
        super().__init__(request_id, prompt_ids, params, table)
        self.shape = shape
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.processed_logprobs: list[float] = []
        self.cumulative: list[float] = []
        self.ranks: list[int] = []
        self.entropies: list[float] = []
        self.is_stop: list[bool] = []
        self.frontier: list[int] = [-1]
        self.level = 0  # depth of the frontier's nodes (0: the prompt)
        self.num_forward_tokens = 0
        self.is_done = False

    @classmethod
    def from_request(cls, request: GenerationRequest, table: TokenTable) -> "TreeGroup":
        group = cls(request.request_id, list(request.prompt_ids), request.params, table, request.tree)
        group.priority = request.priority
        return group

    @property
    def is_finished(self) -> bool:
        return self.is_done

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    def lineage(self, node: int) -> list[int]:
        """The node's ancestors and itself, the prompt's child first ([] for the prompt, -1)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def path(self, node: int) -> list[int]:
        """The token ids from the prompt's end down to the node, itself included."""
        return [self.token_ids[n] for n in self.lineage(node)]

    def grow(self, children: Children) -> None:
        """Add the children of each frontier node (row r: frontier[r]); the next frontier is the new
        nodes that are no stop token, unless the tree is as deep as asked."""
        self.num_forward_tokens += self.num_prompt_tokens if self.level == 0 else len(self.frontier)
        level, stop_ids, grown = self.level + 1, self.params.stop_token_ids, []
        for row, parent in enumerate(self.frontier):
            base = 0.0 if parent < 0 else self.cumulative[parent]
            for j in range(int(children.counts[row])):
                token, logprob = int(children.token_ids[row, j]), float(children.logprobs[row, j])
                stops = token in stop_ids
                if not stops:
                    grown.append(len(self.token_ids))
                self.parents.append(parent)
                self.depths.append(level)
                self.token_ids.append(token)
                self.logprobs.append(logprob)
                self.processed_logprobs.append(float(children.processed_logprobs[row, j]))
                self.cumulative.append(base + logprob)
                self.ranks.append(int(children.ranks[row, j]))
                self.entropies.append(float(children.entropies[row]))
                self.is_stop.append(stops)
        self.level = level
        self.frontier = grown if level < self.shape.depth else []
        self.is_done = not self.frontier

    def output(self) -> GenerationOutput:
        tree = TokenTree(
            parents=np.asarray(self.parents, dtype=np.int64), depths=np.asarray(self.depths, dtype=np.int64),
            token_ids=np.asarray(self.token_ids, dtype=np.int64),
            logprobs=np.asarray(self.logprobs, dtype=np.float32),
            processed_logprobs=np.asarray(self.processed_logprobs, dtype=np.float32),
            cumulative_logprobs=np.asarray(self.cumulative, dtype=np.float64),
            ranks=np.asarray(self.ranks, dtype=np.int64), entropies=np.asarray(self.entropies, dtype=np.float32),
            is_stop=np.asarray(self.is_stop, dtype=bool), num_forward_tokens=self.num_forward_tokens)
        return GenerationOutput(self.request_id, self.num_prompt_tokens, None, [], tree=tree)


def group_for(request: GenerationRequest, table: TokenTable) -> SequenceGroup:
    """The engine's group of a request: a `TreeGroup` for a tree, else a `SequenceGroup`."""
    if request.tree is not None:
        return TreeGroup.from_request(request, table)
    return SequenceGroup.from_request(request, table)
