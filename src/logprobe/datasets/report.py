"""What a scored dataset looks like: the distribution of per-row perplexity as a histogram
(`logprobe score --input ... --plot hist.png`) and a text report of the rows with the highest and lowest
perplexity and the most surprising tokens (`--report`).

Both take the output table of a job (the columns of docs/datasets.md), not the engine: they work on a
table read back from any output file (`pyarrow.parquet.read_table("out.parquet")`).
"""

from __future__ import annotations

import dataclasses
import math

import pyarrow as pa

from .columns import schema
from .io import DatasetError, format_of, read_rows

SNIPPET_CHARS = 60  # a row's text in the report, cut to this many characters


def scored_perplexities(table: pa.Table) -> list[tuple[str, float, int]]:
    """(id, perplexity, num_tokens) of every row with a perplexity, in the table's order. Rows without
    one (no token scored, or an `error` under --skip-invalid) have none to show."""
    ids = table.column("id").to_pylist()
    perplexities = table.column("perplexity").to_pylist()
    counts = table.column("num_tokens").to_pylist()
    return [(i, p, n) for i, p, n in zip(ids, perplexities, counts) if p is not None and math.isfinite(p)]


def plot_perplexity(table: pa.Table, path: str, bins: int = 40) -> int:
    """A histogram of per-row perplexity, saved as PNG at `path`; returns the number of rows drawn.

    Perplexities of real text span orders of magnitude (a list of numbers against a paragraph of
    prose), so the bins are spaced evenly in log10 and the x axis is logarithmic; the median is
    marked. ValueError when no row has a perplexity.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    values = np.array([p for _, p, _ in scored_perplexities(table)], dtype=np.float64)
    if values.size == 0:
        raise ValueError("no row has a perplexity to plot (every row is empty or failed)")
    low, high = values.min(), values.max()
    if high <= low * 1.0001:  # one value (or all equal): a visible bar around it
        low, high = low / 1.1, high * 1.1
    edges = np.geomspace(low, high, num=max(2, min(bins, values.size) + 1))
    median = float(np.median(values))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.hist(values, bins=edges, color="steelblue", edgecolor="white")
    ax.axvline(median, color="darkred", linestyle="--", label=f"median {median:,.1f}")
    ax.set_xscale("log")
    ax.set_xlabel("perplexity (log scale)")
    ax.set_ylabel("rows")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    skipped = table.num_rows - values.size
    title = f"Per-row perplexity, {values.size} rows"
    ax.set_title(title + (f" ({skipped} without one)" if skipped else ""))
    ax.grid(True, linestyle="--", alpha=0.4)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return int(values.size)


def extreme_rows(table: pa.Table, count: int = 5) -> tuple[list[tuple[str, float, int]], list[tuple[str, float, int]]]:
    """The `count` rows of highest perplexity (highest first) and of lowest (lowest first); ties keep
    the table's order."""
    rows = scored_perplexities(table)
    by_perplexity = sorted(range(len(rows)), key=lambda k: rows[k][1])
    lowest = [rows[k] for k in by_perplexity[:count]]
    highest = [rows[k] for k in sorted(range(len(rows)), key=lambda k: -rows[k][1])[:count]]
    return highest, lowest


def surprising_tokens(table: pa.Table, count: int = 10) -> list[dict]:
    """The `count` scored tokens of lowest log probability across the dataset, lowest first: each a
    dict of id, position (in the row's scored tokens), token, logprob and rank (when the table has
    ranks). Needs the `--tokens` columns (`tokens`, `token_logprobs`); ValueError without them."""
    missing = [name for name in ("tokens", "token_logprobs") if name not in table.column_names]
    if missing:
        raise ValueError(f"the table has no {' or '.join(missing)} column (score with --tokens)")
    ids = table.column("id").to_pylist()
    tokens = table.column("tokens").to_pylist()
    logprobs = table.column("token_logprobs").to_pylist()
    ranks = table.column("ranks").to_pylist() if "ranks" in table.column_names else [None] * len(ids)
    found = []
    for row_id, row_tokens, row_logprobs, row_ranks in zip(ids, tokens, logprobs, ranks):
        for position, (token, logprob) in enumerate(zip(row_tokens or [], row_logprobs or [])):
            if logprob is None:
                continue
            rank = row_ranks[position] if row_ranks else None
            found.append({"id": row_id, "position": position, "token": token, "logprob": logprob, "rank": rank})
    found.sort(key=lambda t: t["logprob"])  # stable: ties keep dataset order
    return found[:count]


def _snippet(text: str | None) -> str:
    if text is None:
        return ""
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= SNIPPET_CHARS else flat[:SNIPPET_CHARS - 3] + "...")


def format_report(table: pa.Table, texts: dict[str, str] | None = None, rows: int = 5, tokens: int = 10) -> str:
    """The `--report` text: counts, the highest- and lowest-perplexity rows (with their text when
    `texts` maps ids to it), and the most surprising tokens (or a line saying they need --tokens)."""
    scored = scored_perplexities(table)
    lines = [f"{table.num_rows} rows, {len(scored)} with a perplexity"]
    if "error" in table.column_names:
        failed = table.num_rows - table.column("error").null_count
        if failed:
            lines[0] += f", {failed} not scored (see the error column)"
    highest, lowest = extreme_rows(table, rows)
    texts = texts or {}
    for title, chosen in (("highest perplexity", highest), ("lowest perplexity", lowest)):
        lines += ["", f"{title}:", f"  {'perplexity':>12} {'tokens':>7}  id"]
        lines += [f"  {p:>12,.1f} {n:>7}  {i} {_snippet(texts.get(i))}".rstrip() for i, p, n in chosen]
    lines += ["", "most surprising tokens:"]
    try:
        found = surprising_tokens(table, tokens)
    except ValueError:
        lines.append("  (they need the per-token columns: score with --tokens)")
        return "\n".join(lines)
    lines.append(f"  {'logprob':>10} {'rank':>7} {'position':>8}  token  id")
    for t in found:
        rank = "-" if t["rank"] is None else str(t["rank"])
        lines.append(f"  {t['logprob']:>10.4f} {rank:>7} {t['position']:>8}  {t['token']!r}  {t['id']}")
    return "\n".join(lines)


def read_output(path: str, options) -> pa.Table:
    """A job's output file back as a table with the columns' types (columns.schema): Parquet as it is,
    JSON lines by the schema, CSV with its list cells' JSON text decoded."""
    import json

    out_schema = schema(options)
    kind = format_of(path)
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path)
    if kind == "jsonl":
        with open(path, encoding="utf-8") as fh:
            return pa.Table.from_pylist([json.loads(line) for line in fh if line.strip()], schema=out_schema)
    import pyarrow.csv as pacsv

    as_text = {f.name: pa.string() for f in out_schema}
    raw = pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(column_types=as_text)).to_pylist()
    for record in raw:
        for f in out_schema:
            cell = record.get(f.name)
            if cell in (None, ""):
                record[f.name] = None
            elif not pa.types.is_string(f.type):
                record[f.name] = json.loads(cell)
    return pa.Table.from_pylist(raw, schema=out_schema)


def summarize_job(output_path: str, options, input_path: str, read_opts, plot_path: str | None,
                  with_report: bool, quiet: bool = False) -> None:
    """What `--plot PNG` and `--report` do after a dataset job: the histogram of the output's perplexity,
    then the report on stdout (rows shown with their text, read again from the input). DatasetError
    when there is nothing to plot."""
    import sys

    table = read_output(output_path, options)
    if plot_path:
        try:
            drawn = plot_perplexity(table, plot_path)
        except ValueError as exc:
            raise DatasetError(f"--plot: {exc}") from None
        if not quiet:
            print(f"logprobe score: a histogram of {drawn} rows' perplexity written to {plot_path}", file=sys.stderr)
    if with_report:
        rows = read_rows(input_path, **dataclasses.asdict(read_opts))
        print(format_report(table, texts={row.id: row.text for row in rows}))
