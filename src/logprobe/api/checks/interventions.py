"""`interventions` (docs/api.md, section 2.4): each item's parsing (types, ops, vectors) before the
model is known (the field itself and `return_unmodified` are declared in checks/sampling.py), then
their checks against the model and the tokenized prompts (layers, vector length, positions, patch
sources) before anything is queued."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import math

import numpy as np

from ...backend import Intervention, SamplingParams
from ...config import Limits
from ..errors import ContextLengthExceeded, InvalidRequest
from .vocabulary import check_token_ids

NAME = "interventions"
OPS = ("add", "scale", "zero", "set", "patch")
FIELDS = {"layer", "op", "positions", "vector", "factor", "source"}
NEEDS = {"add": "vector", "set": "vector", "scale": "factor", "patch": "source"}


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_intervention(item: dict, name: str) -> Intervention:
    """One item of `interventions` (its types, op and fields); the model's checks come later."""
    unknown = [key for key in item if key not in FIELDS]
    if unknown:
        raise InvalidRequest(f"Unrecognized field in '{name}': {unknown[0]} (expected layer, op, positions, "
                             "vector, factor, source).", f"{name}.{unknown[0]}")
    layer = item.get("layer")
    if not _int(layer):
        raise InvalidRequest(f"Invalid value for '{name}.layer': expected a layer index (an integer).",
                             f"{name}.layer")
    op = item.get("op")
    if op not in OPS:
        raise InvalidRequest(f"Invalid value for '{name}.op': expected one of {', '.join(OPS)}.", f"{name}.op")
    for key in ("vector", "factor", "source"):
        if key in item and item[key] is not None and NEEDS.get(op) != key:
            raise InvalidRequest(f"'{name}.{key}' does not go with op '{op}'.", f"{name}.{key}")
    needed = NEEDS.get(op)
    if needed is not None and item.get(needed) is None:
        raise InvalidRequest(f"Missing '{name}.{needed}': op '{op}' needs it.", f"{name}.{needed}")
    positions = item.get("positions")
    if positions is not None:
        if not isinstance(positions, list) or not positions or not all(_int(p) for p in positions):
            raise InvalidRequest(f"Invalid value for '{name}.positions': expected a non-empty array of token "
                                 "positions (integers), or null for every position.", f"{name}.positions")
        positions = tuple(positions)
    out = Intervention(layer=layer, op="scale" if op == "zero" else op, positions=positions,
                       factor=0.0 if op == "zero" else 1.0)
    if op in ("add", "set"):
        out.vector = _vector(item["vector"], f"{name}.vector")
    elif op == "scale":
        factor = item["factor"]
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not math.isfinite(factor):
            raise InvalidRequest(f"Invalid value for '{name}.factor': expected a finite number.", f"{name}.factor")
        out.factor = float(factor)
    elif op == "patch":
        _source(item["source"], f"{name}.source", out)
    return out


def _vector(value, name: str) -> np.ndarray:
    """A vector as base64 of little-endian float32 (what output_residual_stream returns) or a JSON array
    of numbers; d_model long (checked against the model later), finite."""
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest(f"Invalid value for '{name}': not valid base64.", name) from None
        if not raw or len(raw) % 4:
            raise InvalidRequest(f"Invalid value for '{name}': {len(raw)} bytes is not a whole number of float32 "
                                 "values.", name)
        vector = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    elif isinstance(value, list) and value and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                   for x in value):
        vector = np.asarray(value, dtype=np.float64)
        if np.isfinite(vector).all() and np.abs(vector).max() > np.finfo(np.float32).max:
            raise InvalidRequest(f"Invalid value for '{name}': a value is too large for float32.", name)
        vector = vector.astype(np.float32)
    else:
        raise InvalidRequest(f"Invalid type for '{name}': expected base64 of little-endian float32 values or an "
                             "array of numbers.", name)
    if not np.isfinite(vector).all():
        raise InvalidRequest(f"Invalid value for '{name}': every value must be finite.", name)
    return vector


def _source(value, name: str, out: Intervention) -> None:
    if not isinstance(value, dict):
        raise InvalidRequest(f"Invalid type for '{name}': expected an object with 'prompt' (and 'position', "
                             "'layer').", name)
    unknown = [key for key in value if key not in ("prompt", "position", "layer")]
    if unknown:
        raise InvalidRequest(f"Unrecognized field in '{name}': {unknown[0]} (expected prompt, position, layer).",
                             f"{name}.{unknown[0]}")
    prompt = value.get("prompt")
    if isinstance(prompt, str) and prompt:
        out.source_text = prompt
    elif isinstance(prompt, list) and prompt and all(_int(t) for t in prompt):
        out.source_ids = tuple(prompt)
    else:
        raise InvalidRequest(f"Invalid value for '{name}.prompt': expected a non-empty string or array of token "
                             "ids.", f"{name}.prompt")
    position = value.get("position", -1)
    if position is None:
        position = -1
    layer = value.get("layer")
    for key, item in (("position", position), ("layer", layer)):
        if item is not None and not _int(item):
            raise InvalidRequest(f"Invalid value for '{name}.{key}': expected an integer.", f"{name}.{key}")
    out.source_position, out.source_layer = position, layer


def check_interventions(backend, prompts: list[list[int]], params: SamplingParams, limits: Limits) -> None:
    """Check each intervention against the model and the tokenized prompts (400 naming the field)."""
    checked_interventions(backend, prompts, params)


def checked_interventions(backend, prompts: list[list[int]], params: SamplingParams) -> tuple:
    """The interventions as the engine runs them (new records; `params` is left as it is): layers as
    0..num_layers, patch sources as token ids with their position and layer in range. Raises as
    `check_interventions` does."""
    if not params.interventions:
        return params.interventions
    info = backend.info
    top, ctx = info.num_layers + 1, info.context_length
    shortest, longest = min(len(ids) for ids in prompts), max(len(ids) for ids in prompts)
    source_tokens = 0
    checked = []
    for i, item in enumerate(params.interventions):
        name = f"{NAME}[{i}]"
        item = dataclasses.replace(item)
        layer_name = f"{name}.layer"
        if not -top <= item.layer < top:
            raise InvalidRequest(f"Invalid value for '{layer_name}': layer {item.layer} does not exist; this model "
                                 f"has layers 0 to {top - 1} (or -{top} to -1).", layer_name)
        item.layer %= top
        if item.vector is not None and item.vector.shape[0] != info.d_model:
            raise InvalidRequest(f"Invalid value for '{name}.vector': {item.vector.shape[0]} values, but this "
                                 f"model's residual stream has d_model = {info.d_model}.", f"{name}.vector")
        if item.positions is not None:
            for p in item.positions:
                if p < -shortest or p >= longest + params.max_tokens:
                    raise InvalidRequest(
                        f"Invalid value for '{name}.positions': position {p} is outside every sequence of this "
                        f"request (prompts of {shortest} to {longest} tokens, then up to {params.max_tokens} "
                        f"generated); a negative position counts from the end of each prompt.", f"{name}.positions")
        if item.op == "patch":
            item.source_ids = tuple(_source_ids(backend, item, f"{name}.source.prompt"))
            n = len(item.source_ids)
            source_tokens += n
            if source_tokens > ctx:
                raise ContextLengthExceeded(
                    f"The patch sources of this request have {source_tokens} tokens in all, over this model's "
                    f"context length of {ctx}: each source is a forward pass of its own.", f"{name}.source.prompt")
            if not -n <= item.source_position < n:
                raise InvalidRequest(f"Invalid value for '{name}.source.position': the source prompt has {n} "
                                     f"tokens (positions 0 to {n - 1}, or -{n} to -1).", f"{name}.source.position")
            if item.source_layer is not None:
                if not -top <= item.source_layer < top:
                    raise InvalidRequest(f"Invalid value for '{name}.source.layer': layer {item.source_layer} does "
                                         f"not exist; this model has layers 0 to {top - 1} (or -{top} to -1).",
                                         f"{name}.source.layer")
                item.source_layer %= top
        checked.append(item)
    return tuple(checked)


def _source_ids(backend, item: Intervention, name: str) -> list[int]:
    if item.source_text is not None:
        if len(item.source_text) > backend.info.context_length * (backend.table.max_token_bytes + 1):
            raise ContextLengthExceeded(f"The patch source of '{name}' is longer than this model's context.", name)
        ids = list(backend.tokenizer(item.source_text).input_ids)
        if not ids:
            raise InvalidRequest(f"Invalid value for '{name}': the text has no tokens.", name)
        return ids
    check_token_ids(item.source_ids, backend.info.vocab_size, name)
    return list(item.source_ids)
