"""`logprobe.datasets.score(...)`: a dataset's scores as a pyarrow Table, for notebooks and scripts."""

from __future__ import annotations

from .columns import ScoreOptions, to_table
from .io import DatasetError, Row, require_data_extra, rows_of_columns
from .job import chunks, run_sync, score_chunks


def score(data, column: str | None = None, context=None, ids=None, model: str | None = None,
          url: str | list[str] | None = None, top: int = 0, tokens: bool = False, stats: bool = False,
          progress: bool = True, engine=None, add_bos: bool = True, skip_invalid: bool = False,
          api_key: str | None = None, concurrency: int = 8):
    """Score every text of `data` and return a pyarrow Table, one row per text in order (`.to_pandas()`
    for a DataFrame; the columns are those of `logprobe score --input`, docs/datasets.md).

    `data`: an iterable of str, a pandas Series, or a table with `column` (default "text"): a pandas
    DataFrame, a pyarrow Table, a Hugging Face `datasets.Dataset`. For a table, `context` and `ids`
    name columns; otherwise `context` is one string for every text or a list (one per text) and `ids`
    a list. Scored on `engine` (a started Engine), on the servers at `url`, or on `model` loaded here
    (None: the bundled model). `progress`: a tqdm bar (a widget in Jupyter)."""
    require_data_extra()
    rows = _rows_of(data, column, context, ids)
    options = ScoreOptions(top=top, tokens=tokens, stats=stats, add_bos=add_bos, skip_invalid=skip_invalid)
    # the scorers, and tqdm for the progress bar, load with a call (the module needs the data extra only)
    from . import progress as progress_mod
    from .scorer import InProcessScorer, RemoteScorer

    if engine is not None:
        scorer = InProcessScorer(engine, options)
    elif url:
        scorer = RemoteScorer([url] if isinstance(url, str) else list(url), api_key=api_key, model=model,
                              concurrency=concurrency, options=options)
    else:
        scorer = InProcessScorer.from_model(model, options=options)
    try:
        prepared = scorer.prepare(rows)
        scorer.refuse_invalid(prepared)
        records: dict[int, dict] = {}
        bar = progress_mod.make("notebook" if progress else "none", len(rows))

        def on_chunk(chunk, chunk_records):
            records.update((p.row.index, r) for p, r in zip(chunk, chunk_records))

        try:
            run_sync(score_chunks(scorer, chunks(prepared), on_chunk, on_rows=bar.update))
        finally:
            bar.close()
    finally:
        scorer.close()
    return to_table([records[r.index] for r in rows], options)


def _rows_of(data, column, context, ids) -> list[Row]:
    table = _columns_of(data, column)
    if table is not None:
        if context is not None and not isinstance(context, str) or ids is not None and not isinstance(ids, str):
            raise DatasetError("for a table, context= and ids= name its columns")
        return rows_of_columns(table, column or "text", context, ids)
    if isinstance(data, (str, bytes)):
        raise DatasetError("data is one string: pass a list of texts")
    texts = list(data)
    named = {"text": texts}
    if context is not None:
        named["context"] = [context] * len(texts) if isinstance(context, str) else list(context)
    if ids is not None:
        named["id"] = list(ids)
    for name in ("context", "id"):
        if name in named and len(named[name]) != len(texts):
            raise DatasetError(f"{len(named[name])} values of {'ids' if name == 'id' else name} for {len(texts)} texts")
    return rows_of_columns(named, "text", "context" if context is not None else None,
                           "id" if ids is not None else None)


def _columns_of(data, column) -> dict[str, list] | None:
    """Column name -> cells for the table-like kinds of data; None for a plain sequence of texts."""
    kind = type(data).__module__.split(".")[0]
    if kind == "pandas":
        if hasattr(data, "columns"):  # DataFrame
            return {str(name): _pandas_cells(data[name]) for name in data.columns}
        return {column or "text": _pandas_cells(data)}
    if kind == "pyarrow" and hasattr(data, "column_names"):
        return {name: data.column(name).to_pylist() for name in data.column_names}
    if kind == "datasets" and hasattr(data, "column_names"):
        return {name: data[name] for name in data.column_names}
    return None


def _pandas_cells(series) -> list:
    """A Series' cells, its missing values (NaN in a text column) as None."""
    return series.astype(object).where(series.notna(), None).tolist()
