"""Rows in: a dataset file read into `Row`s, checked before anything is scored.

Formats by extension: .jsonl/.json (one JSON object a line), .csv, .parquet, .txt (one text a line).
Every problem a user can fix (a missing column, a cell that is not text, duplicate ids) is a
`DatasetError` whose message names the row and what was found, so the CLI can print it and exit 2.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..config import install_hint

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet", ".txt": "txt"}


class DatasetError(Exception):
    """A problem with the input, the output or the options that the user can fix (exit code 2)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@dataclass
class Row:
    """One text to score. `index`: its position in the input; `id`: the id column's value as text, or
    str(index); `context`: conditioned on, not scored (None: no context)."""

    index: int
    id: str
    text: str
    context: str | None = None
    messages: list | None = None  # a conversation whose last assistant message is scored (`text` is its content)
    asked_ids: list | None = None  # one list of token ids per scored token (logprob_token_ids)

    @property
    def scored(self) -> bool:
        """Whether there is anything to score: a text, or a conversation."""
        return bool(self.text) or self.messages is not None


@dataclass
class Prepared:
    """A row as a scorer took it in: `item` to run (in process: the pipeline's checked /v1/score
    request), or `error` (why it cannot be scored), or neither (an empty text, or a remote scorer,
    whose server checks the row)."""

    row: Row
    item: object | None = None
    error: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.item.prepared[0].token_ids) if self.item is not None else 0


DATA_EXTRA = install_hint("data")


def require_data_extra():
    """pyarrow and tqdm come with the `data` extra; say how to get them when they are missing."""
    try:
        import pyarrow  # noqa: F401
        import tqdm  # noqa: F401
    except ImportError as exc:
        raise DatasetError(f"scoring datasets needs {exc.name}: {DATA_EXTRA}") from None


def format_of(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise DatasetError(f"{path}: unknown file type {ext or '(none)'!r}; use one of "
                           f"{', '.join(sorted(FORMATS))}")
    return FORMATS[ext]


def read_rows(path: str, column: str = "text", context_column: str | None = None,
              id_column: str | None = None, messages_column: str | None = None,
              ids_column: str | None = None) -> list[Row]:
    """The rows of a dataset file, checked: every text and context a string, ids unique; with
    `messages_column` a conversation per row instead of a text, with `ids_column` a list of id lists."""
    require_data_extra()
    kind = format_of(path)
    if kind == "txt":
        if context_column or id_column or messages_column or ids_column:
            raise DatasetError(f"{path}: a .txt file is one text a line; it has no columns to name")
        return [Row(i, str(i), text) for i, text in enumerate(_read_text_lines(path))]
    table = _read_table(path, kind)
    if not table:  # no row, so no column either: say so, not "no column 'text'"
        raise DatasetError(f"{path}: the file is empty: there are no rows to score")
    if messages_column is None:
        rows = rows_of_columns(table, column or "text", context_column, id_column, where=path)
    else:
        rows = conversation_rows(table, messages_column, context_column, id_column, where=path)
    if ids_column is not None:
        add_asked_ids(rows, table, ids_column, where=path)
    return rows


def rows_of_columns(table: dict[str, list], column: str, context_column: str | None, id_column: str | None,
                    where: str = "the data") -> list[Row]:
    """Rows from columns (name -> list of cells), checked as `read_rows` checks a file's."""
    names = list(table)
    for flag, name in (("--column", column), ("--context-column", context_column), ("--id-column", id_column)):
        if name is not None and name not in table:
            raise DatasetError(f"{where}: no column {name!r} ({flag}); the columns are: "
                               f"{', '.join(map(repr, names)) or '(none)'}")
    texts = _checked_texts(table[column], column, where)
    contexts = (_checked_texts(table[context_column], context_column, where, allow_null=True)
                if context_column else [None] * len(texts))
    ids = [str(i) for i in range(len(texts))]
    if id_column:
        ids = [_id_text(value, i, id_column, where) for i, value in enumerate(table[id_column])]
        seen: dict[str, int] = {}
        for i, value in enumerate(ids):
            if value in seen:
                raise DatasetError(f"{where}: id {value!r} (column {id_column!r}) is in rows {seen[value]} and {i}; "
                                   "ids must be unique")
            seen[value] = i
    return [Row(i, row_id, text, ctx or None) for i, (row_id, text, ctx) in enumerate(zip(ids, texts, contexts))]


def conversation_rows(table: dict[str, list], column: str, context_column: str | None, id_column: str | None,
                      where: str = "the data") -> list[Row]:
    """Rows of conversations (--messages-column): each cell an array of {"role", "content"} messages (a
    JSON text in a CSV); `text` is the content of the last assistant message, the one scored."""
    if context_column:
        raise DatasetError("--context-column is for texts: a conversation (--messages-column) is its own context")
    if column not in table:
        raise DatasetError(f"{where}: no column {column!r} (--messages-column); the columns are: "
                           f"{', '.join(map(repr, table)) or '(none)'}")
    conversations = [_json_cell(cell, i, column, where, "an array of messages") for i, cell in enumerate(table[column])]
    for i, conversation in enumerate(conversations):
        if not all(isinstance(m, dict) for m in conversation):
            raise DatasetError(f"{where}: row {i} of column {column!r} is not an array of messages "
                               "({\"role\": ..., \"content\": ...} objects)")
    last = [next((m.get("content") for m in reversed(c) if m.get("role") == "assistant"), None) for c in conversations]
    texts = [content if isinstance(content, str) else "" for content in last]
    rows = rows_of_columns({**table, column: texts}, column, None, id_column, where)
    for row, conversation in zip(rows, conversations):
        row.messages = conversation
    return rows


def add_asked_ids(rows: list[Row], table: dict[str, list], column: str, where: str = "the data") -> None:
    """--ids-column: each row's token ids to read at each scored token, an array of id arrays (a JSON text
    in a CSV), one for every scored token."""
    if column not in table:
        raise DatasetError(f"{where}: no column {column!r} (--ids-column); the columns are: "
                           f"{', '.join(map(repr, table)) or '(none)'}")
    for row, cell in zip(rows, table[column]):
        lists = _json_cell(cell, row.index, column, where, "an array of token-id arrays")
        if not all(isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
                   for ids in lists):
            raise DatasetError(f"{where}: row {row.index} of column {column!r} is not an array of token-id arrays "
                               "(one array of ids per scored token)")
        row.asked_ids = lists


def _json_cell(cell, index: int, name: str, where: str, expected: str) -> list:
    """A cell holding an array: itself (JSONL, Parquet) or a JSON text of it (CSV)."""
    if isinstance(cell, str):
        try:
            cell = json.loads(cell)
        except ValueError:
            raise DatasetError(f"{where}: row {index} of column {name!r} is text that is not JSON; expected "
                               f"{expected}") from None
    if not isinstance(cell, list):
        kind = "null" if cell is None else type(cell).__name__
        raise DatasetError(f"{where}: row {index} of column {name!r} is {kind}; expected {expected}")
    return cell


def _checked_texts(cells: list, name: str, where: str, allow_null: bool = False) -> list:
    for i, cell in enumerate(cells):
        if not isinstance(cell, str) and not (allow_null and cell is None):
            kind = "null" if cell is None else type(cell).__name__
            raise DatasetError(f"{where}: row {i} of column {name!r} is {kind}, not text")
    return list(cells)


def _id_text(value, index: int, name: str, where: str) -> str:
    if value is None or isinstance(value, (list, dict)):
        raise DatasetError(f"{where}: row {index} of column {name!r} is "
                           f"{'null' if value is None else type(value).__name__}; an id must be text or a number")
    return str(value)


def _read_text_lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8", newline="") as fh:
            data = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"cannot read {path}: {_reason(exc)}") from None
    lines = data.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line starts no row
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def _read_table(path: str, kind: str) -> dict[str, list]:
    import pyarrow as pa

    try:
        if kind == "jsonl":
            return _read_jsonl(path)
        if kind == "csv":
            import pyarrow.csv as pacsv

            # Every column as text: a CSV cell has no type, and "007" is an id, not 7
            with open(path, "rb") as fh:
                header = fh.readline().decode("utf-8-sig").rstrip("\r\n")
            names = next(iter(__import__("csv").reader([header])), [])
            convert = pacsv.ConvertOptions(column_types={n: pa.string() for n in names},
                                           strings_can_be_null=False, quoted_strings_can_be_null=False)
            table = pacsv.read_csv(path, convert_options=convert,
                                   parse_options=pacsv.ParseOptions(newlines_in_values=True))
        else:
            import pyarrow.parquet as pq

            table = pq.read_table(path)
    except DatasetError:
        raise
    except (OSError, UnicodeDecodeError, pa.ArrowException) as exc:
        raise DatasetError(f"cannot read {path}: {_reason(exc)}") from None
    return {name: table.column(name).to_pylist() for name in table.column_names}


def _read_jsonl(path: str) -> dict[str, list]:
    records = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise DatasetError(f"cannot read {path}: line {number} is not JSON ({exc})") from None
            if not isinstance(record, dict):
                raise DatasetError(f"cannot read {path}: line {number} is a JSON {type(record).__name__}, "
                                   "not an object")
            records.append(record)
    names = list(dict.fromkeys(name for record in records for name in record))
    return {name: [record.get(name) for record in records] for name in names}


def _reason(exc: Exception) -> str:
    return getattr(exc, "strerror", None) or str(exc).splitlines()[0] if str(exc) else type(exc).__name__
