"""Activations -> the API's `residual_stream` object (base64 little-endian arrays, or JSON lists)."""

from __future__ import annotations

import base64

import numpy as np


def to_bfloat16_bits(matrix: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even as torch does; NaN stays NaN."""
    bits = np.ascontiguousarray(matrix, dtype=np.float32).view(np.uint32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(matrix), np.uint16(0x7FC0), rounded)


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def encode_matrix(matrix: np.ndarray, dtype: str, encoding: str):
    """A [N, D] float32 matrix in the asked dtype: base64 of its little-endian bytes, or nested lists
    (of the values rounded to that dtype)."""
    if dtype == "bfloat16":
        bits = to_bfloat16_bits(matrix)
        if encoding == "json":
            return from_bfloat16_bits(bits).tolist()
        return base64.b64encode(bits.astype("<u2").tobytes()).decode()
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
