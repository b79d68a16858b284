"""Columns out: the same names, types and meaning in every output format.

Always `id`, `num_tokens` (tokens scored: a context is conditioned on, not scored), `logprob` (their
sum), `mean_logprob` and `perplexity` (exp(-mean); both null when no token was scored). `--tokens` adds
per-token lists, `--top K` the k likeliest at each position, `--stats` the entropy (nats) of each
position's distribution, `--ids-column` the asked ids' `asked_logprobs` and `asked_ranks` (a list per
scored token), `--skip-invalid` an `error` column. A list entry is null where nothing predicts the token
(the first token without BOS or context).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScoreOptions:
    """What to compute for every row: `top` k likeliest per position, `tokens` per-token lists,
    `stats` entropy per position, `add_bos` BOS in front (so the first token is scored),
    `skip_invalid` an `error` for rows that cannot be scored instead of refusing the job."""

    top: int = 0
    tokens: bool = False
    stats: bool = False
    add_bos: bool = True
    skip_invalid: bool = False
    asked: bool = False  # rows carry ids to read at each scored token (--ids-column)


def schema(options: ScoreOptions):
    """The pyarrow schema of a result table under these options."""
    import pyarrow as pa

    fields = [("id", pa.string()), ("num_tokens", pa.int64()), ("logprob", pa.float64()),
              ("mean_logprob", pa.float64()), ("perplexity", pa.float64())]
    if options.tokens:
        fields += [("tokens", pa.list_(pa.string())), ("token_ids", pa.list_(pa.int64())),
                   ("token_logprobs", pa.list_(pa.float64())), ("ranks", pa.list_(pa.int64()))]
    if options.top:
        fields += [("top_tokens", pa.list_(pa.list_(pa.string()))), ("top_ids", pa.list_(pa.list_(pa.int64()))),
                   ("top_logprobs", pa.list_(pa.list_(pa.float64())))]
    if options.stats:
        fields.append(("entropy", pa.list_(pa.float64())))
    if options.asked:
        fields += [("asked_logprobs", pa.list_(pa.list_(pa.float64()))),
                   ("asked_ranks", pa.list_(pa.list_(pa.int64())))]
    if options.skip_invalid:
        fields.append(("error", pa.string()))
    return pa.schema(fields)


def to_table(records: list[dict], options: ScoreOptions):
    """A table of records (dicts with the schema's names; a missing name is null), in the given order."""
    import pyarrow as pa

    out_schema = schema(options)
    return pa.table({f.name: pa.array([r.get(f.name) for r in records], type=f.type) for f in out_schema},
                    schema=out_schema)


def summary(row_id: str, num_tokens: int, total: float, mean: float | None, perplexity: float | None) -> dict:
    return {"id": row_id, "num_tokens": num_tokens, "logprob": total, "mean_logprob": mean, "perplexity": perplexity}


def error_record(row_id: str, message: str) -> dict:
    """A row that could not be scored (--skip-invalid): null numbers, the reason in `error`."""
    return {"id": row_id, "error": message}


def empty_record(row_id: str, options: ScoreOptions) -> dict:
    """An empty text: nothing to score, so no tokens, a sum of 0 and no mean."""
    record = {"id": row_id, "num_tokens": 0, "logprob": 0.0}
    if options.tokens:
        record.update(tokens=[], token_ids=[], token_logprobs=[], ranks=[])
    if options.top:
        record.update(top_tokens=[], top_ids=[], top_logprobs=[])
    if options.stats:
        record["entropy"] = []
    if options.asked:
        record.update(asked_logprobs=[], asked_ranks=[])
    return record


def asked_columns(block: dict) -> dict:
    """A /v1/score entry's `logprob_token_ids` block as the record's columns."""
    return {"asked_logprobs": block["logprobs"], "asked_ranks": block["ranks"]}
