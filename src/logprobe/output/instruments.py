"""Numpy columns of the researcher's instruments (backend.PositionColumns) -> the response's blocks:
`logprob_token_ids`, `position_stats`, and the top_logprobs of asked ids (docs/api.md, section 2.3)."""

from __future__ import annotations

import numpy as np

from ..backend import PositionColumns
from .logprobs import TokenNamer, wire_floats


def _rows(values: np.ndarray, first_is_null: bool) -> list:
    """A [N, K] (or [N]) column as JSON lists; row 0 null for prompt columns."""
    out = values.tolist()
    if first_is_null and out:
        out[0] = None
    return out


def logprob_token_ids_block(prompt: PositionColumns | None, generated: PositionColumns) -> dict:
    """{"token_ids", "prompt_logprobs", "prompt_ranks", "logprobs", "ranks"}: the asked ids' raw log
    probabilities and ranks at every prompt position (null at position 0) and every kept generated token."""
    out = {"token_ids": generated.token_ids.tolist()}
    if prompt is not None:
        out["prompt_logprobs"] = _rows(wire_floats(prompt.token_id_logprobs), True)
        out["prompt_ranks"] = _rows(prompt.token_id_ranks, True)
    out["logprobs"] = wire_floats(generated.token_id_logprobs).tolist()
    out["ranks"] = generated.token_id_ranks.tolist()
    return out


def _top_p_entries(cols: PositionColumns, namer: TokenNamer, first_is_null: bool) -> list:
    counts = cols.top_p_counts.tolist()
    masses = cols.top_p_mass.astype(np.float64).tolist()
    truncated = cols.top_p_truncated.tolist()
    out = []
    for row, count in enumerate(counts):
        ids = cols.top_p_ids[row, :count]
        out.append({"token_ids": ids.tolist(), "tokens": namer.names(ids),
                    "logprobs": wire_floats(cols.top_p_logprobs[row, :count]).tolist(),
                    "mass": masses[row], "truncated": truncated[row]})
    if first_is_null and out:
        out[0] = None
    return out


def stats_section(cols: PositionColumns, ranks: np.ndarray | None, namer: TokenNamer, is_prompt: bool) -> dict:
    """One section of `position_stats` ("prompt" or "generated"): per position `entropy` (nats) and the
    actual token's `rank` when position_stats was asked, `top_p` when top_logprobs_p was."""
    out = {}
    if cols.entropy is not None:
        entropy = cols.entropy.astype(np.float64).tolist()
        out["entropy"] = [None] + entropy[1:] if is_prompt and entropy else entropy
        out["rank"] = _rows(ranks, is_prompt)
    if cols.top_p is not None:
        out["top_p"] = _top_p_entries(cols, namer, is_prompt)
    return out


def position_stats_block(prompt: PositionColumns | None, prompt_ranks: np.ndarray | None,
                         generated: PositionColumns, namer: TokenNamer) -> dict:
    out = {}
    if prompt is not None:
        out["prompt"] = stats_section(prompt, prompt_ranks, namer, True)
    out["generated"] = stats_section(generated, generated.ranks, namer, False)
    return out


def asked_ids_top(generated: PositionColumns, processed: bool) -> tuple[np.ndarray, np.ndarray]:
    """(top ids [T, K], their log probabilities [T, K]) for the generated tokens' top_logprobs when
    `logprob_token_ids` replaces the k likeliest (vLLM): the asked ids at every position."""
    values = generated.token_id_logprobs_processed if processed else generated.token_id_logprobs
    num = values.shape[0]
    return np.broadcast_to(generated.token_ids, (num, len(generated.token_ids))), values


def join_legacy(prompt_part: dict, generated_part: dict) -> dict:
    """Two completions `logprobs` objects (an echoed prompt's, then the generated tokens') as one."""
    return {key: prompt_part[key] + generated_part[key] for key in prompt_part}


def chat_tops_with_token(content: list[dict], ids: np.ndarray, asked: np.ndarray, values: np.ndarray,
                         namer: TokenNamer, token_bytes: list[bytes]) -> list[dict]:
    """Chat `logprobs.content` whose top_logprobs hold the sampled token, then every asked id (each
    once, in the order asked), as vLLM returns them with logprob_token_ids."""
    names = namer.names(asked)
    asked_list = asked.tolist()
    for row, entry in enumerate(content):
        token = int(ids[row])
        tops = [{"token": entry["token"], "logprob": entry["logprob"], "bytes": entry["bytes"]}]
        seen = {token}
        row_values = wire_floats(values[row]).tolist()
        for j, tid in enumerate(asked_list):
            if tid in seen:
                continue
            seen.add(tid)
            tops.append({"token": names[j], "logprob": row_values[j], "bytes": list(token_bytes[tid])})
        entry["top_logprobs"] = tops
    return content
