"""Interventions in the forward pass (docs/api.md, section 2.4): a request's changes to the residual
stream, applied to its own rows of every pass that runs its tokens (prefill, each decode step, and the
passes that read its activations or logit lens), and to no other request's rows.

The API hands over `Intervention`s as it validated them (backend/). Before a group's first pass the
engine resolves them into `Edits`: positions made absolute (negative ones count from the prompt's end),
vectors on the device, and each patch's vector read from a pass over its source prompt. The runners
call `Edits.apply` where they would capture the residual stream: on the embeddings (layer 0) and on
each block's output (layer l), so layer numbers mean what `output_residual_stream` means by them.
"""

from __future__ import annotations

import numpy as np
import torch

from ...backend import Intervention


class Edits:
    """One group's interventions, resolved: per layer, in the order asked, (op, positions, value) with
    op "add" (value a [D] float32 vector), "scale" (a float) or "set" (a [D] vector); positions a sorted
    int64 tensor of absolute positions, or None for every position."""

    def __init__(self, by_layer: dict[int, list[tuple[str, torch.Tensor | None, object]]]):
        self.by_layer = by_layer

    @classmethod
    def resolve(cls, interventions: tuple[Intervention, ...], prompt_length: int, device: torch.device,
                stream_of) -> "Edits":
        """`stream_of(ids, layer)` returns the [len(ids), D] float32 residual stream of a clean pass over
        `ids` at `layer` (the runner's `residual_stream`); it reads each patch's vector."""
        by_layer: dict[int, list] = {}
        for item in interventions:
            positions = None
            if item.positions is not None:
                absolute = sorted({p + prompt_length if p < 0 else p for p in item.positions})
                positions = torch.tensor(absolute, dtype=torch.int64, device=device)
            if item.op == "scale":
                value = float(item.factor)
            elif item.op == "patch":
                source = list(item.source_ids)
                layer = item.layer if item.source_layer is None else item.source_layer
                at = item.source_position + len(source) if item.source_position < 0 else item.source_position
                value = torch.as_tensor(np.asarray(stream_of(source, layer)[at], dtype=np.float32), device=device)
            else:
                value = torch.as_tensor(np.asarray(item.vector, dtype=np.float32), device=device)
            by_layer.setdefault(item.layer, []).append(("scale" if item.op == "scale" else
                                                        "add" if item.op == "add" else "set", positions, value))
        return cls(by_layer)

    def apply(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, D] (the stream at `positions` [T]) with this layer's changes, in the order asked, each
        computed in float32 and rounded once to x's dtype."""
        for op, where, value in self.by_layer.get(layer, ()):
            mask = None if where is None else torch.isin(positions, where)[:, None]
            x32 = x.float()
            new = x32 + value if op == "add" else x32 * value if op == "scale" else value.expand_as(x32)
            x = (new if mask is None else torch.where(mask, new, x32)).to(x.dtype)
        return x


def segment_editor(segments: list[tuple[int, int, int, Edits]]):
    """`edit(layer, x, positions)` for a pass over several requests' tokens (x [B, T, D], positions
    [B, T]): each segment (row, start, stop, edits) is one group's tokens x[row, start:stop]; the rest of
    the batch is not touched. None when no segment has edits (the pass runs as it would without)."""
    segments = [s for s in segments if s[3] is not None]
    if not segments:
        return None
    layers = {layer for *_, edits in segments for layer in edits.by_layer}

    def edit(layer: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if layer not in layers:
            return x
        x = x.clone()
        for row, start, stop, edits in segments:
            if layer in edits.by_layer:
                x[row, start:stop] = edits.apply(layer, x[row, start:stop], positions[row, start:stop])
        return x

    return edit
