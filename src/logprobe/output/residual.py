"""Activations -> the API's `residual_stream` object (base64 little-endian arrays, or JSON lists)."""

from __future__ import annotations

import base64

import numpy as np
import torch


def encode_matrix(matrix: np.ndarray, dtype: str, encoding: str):
    """A [N, D] float32 matrix in the asked dtype: base64 of its little-endian bytes, or nested lists
    (of the values rounded to that dtype)."""
    if dtype == "bfloat16":
        as_bf16 = torch.from_numpy(np.ascontiguousarray(matrix)).to(torch.bfloat16)
        if encoding == "json":
            return as_bf16.float().tolist()
        return base64.b64encode(as_bf16.view(torch.int16).numpy().astype("<i2").tobytes()).decode()
    arr = np.ascontiguousarray(matrix, dtype="<f4" if dtype == "float32" else "<f2")
    if encoding == "json":
        return arr.astype(np.float32).tolist()
    return base64.b64encode(arr.tobytes()).decode()


def residual_payload(residual: dict[int, np.ndarray], asked: list[int], num_layers: int, dtype: str,
                     encoding: str, rows: slice = slice(None)) -> dict:
    """`{"layers", "num_positions", "d_model", "dtype", "encoding", "data": {"<layer>": ...}}`, keyed
    by the layer indices as asked (negative ones count from the end: -1 is num_layers)."""
    data, num, d_model = {}, 0, 0
    for layer in asked:
        matrix = residual[layer % (num_layers + 1)][rows]
        num, d_model = matrix.shape
        data[str(layer)] = encode_matrix(matrix, dtype, encoding)
    return {"layers": list(asked), "num_positions": num, "d_model": d_model, "dtype": dtype,
            "encoding": encoding, "data": data}
