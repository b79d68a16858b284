"""The input of a Ray job, read by the cluster's workers with Ray Data's readers, never whole on the driver.

The input is a file, a directory or a glob of files of one format. The driver lists the files (sorted by
path) and reads nothing of them but a CSV's header line and a hash of each file's ends for the manifest.
Ray Data reads them (`read_parquet`, `read_csv`, `read_json`; a .txt file through `read_binary_files`
and the in-process job's own line split, because `read_text` also splits at \\r, \\f, U+2028 and the like,
which would make other rows than in process) with `preserve_order`, so its blocks come out in input order
whatever the read parallelism. The driver sees only each block's row count and reference, and gives the
k-th block the rows from `start` = the rows of the blocks before it: a row's index is its position in the
input (files in path order, rows in file order), the same on every run, as the in-process job numbers a
file's rows. This needs no pass over the data beyond the one read, and no row number from the reader.

One Ray task per block then checks the block's cells as `io.rows_of_columns` checks a file (the same
messages, the row named by its input index), drops the rows already in the parts (a resume), orders the
others by context and length (within the block: a global order would need every row in one place), and
cuts them into the chunks the actor pool scores; the chunks wait in Ray's object store (which
spills to disk) until scored. Each task reports its first problem instead of raising,
so that the driver names the same one the in-process job would (the first missing column, else the first
bad text, context, id, in input order), before any chunk is scored. Duplicate ids are found by hashing
each id into one of up to 64 buckets (one a block) and checking each bucket in a task of its own.
"""

from __future__ import annotations

import glob
import os

from .io import FORMATS, DatasetError

INDEX = "__row_index"  # a row's position in the input
FLAGS = (("--column", "text"), ("--context-column", "context"), ("--id-column", "id"))


def input_files(input_path: str) -> tuple[list[str], str]:
    """The files of a file, directory or glob, sorted by path, and their one format."""
    if any(c in input_path for c in "*?["):
        files = sorted(p for p in glob.glob(input_path, recursive=True) if os.path.isfile(p))
    elif os.path.isdir(input_path):
        files = sorted(os.path.join(root, name) for root, dirs, names in os.walk(input_path) for name in names
                       if not name.startswith((".", "_")))  # .crc, _SUCCESS and the like are no data
    elif os.path.isfile(input_path):
        files = [input_path]
    else:
        raise DatasetError(f"cannot read {input_path}: No such file or directory")
    if not files:
        raise DatasetError(f"cannot read {input_path}: no files there")
    kinds = {FORMATS.get(os.path.splitext(p)[1].lower()) for p in files}
    if None in kinds or len(kinds) > 1:
        exts = sorted({os.path.splitext(p)[1].lower() or "(none)" for p in files})
        raise DatasetError(f"{input_path}: the files must all be of one type of {', '.join(sorted(FORMATS))}; "
                           f"found {', '.join(exts)}")
    return files, kinds.pop()


def check_options(input_path: str, kind: str, read_opts) -> None:
    """What can be refused before Ray starts."""
    if kind == "txt" and (read_opts.context_column or read_opts.id_column):
        raise DatasetError(f"{input_path}: a .txt file is one text a line; it has no columns to name")


def read(files: list[str], kind: str):
    """A Ray Dataset of the files' rows, in input order (`preserve_order` must be set by the caller)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import ray.data

    if kind == "parquet":
        return ray.data.read_parquet(files, file_extensions=None)
    if kind == "jsonl":
        return ray.data.read_json(files, file_extensions=None)
    if kind == "csv":
        # Every column as text, as in process: a CSV cell has no type, and "007" is an id, not 7
        names = [name for path in files for name in _csv_header(path)]
        convert = pacsv.ConvertOptions(column_types={n: pa.string() for n in names},
                                       strings_can_be_null=False, quoted_strings_can_be_null=False)
        return ray.data.read_csv(files, file_extensions=None, convert_options=convert,
                                 parse_options=pacsv.ParseOptions(newlines_in_values=True))
    return ray.data.read_binary_files(files, file_extensions=None).map_batches(
        _text_lines, batch_size=1, batch_format="pyarrow")


def _csv_header(path: str) -> list[str]:
    import csv

    try:
        with open(path, "rb") as fh:
            header = fh.readline().decode("utf-8-sig").rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    return next(iter(csv.reader([header])), [])


def _text_lines(batch):
    """A .txt file's bytes -> its lines, split as io.read_rows splits them (at \\n, a \\r before it dropped)."""
    import pyarrow as pa

    lines = []
    for data in batch.column("bytes").to_pylist():
        try:
            file_lines = data.decode("utf-8").split("\n")
        except UnicodeDecodeError as exc:
            raise DatasetError(f"not UTF-8 text: {exc}") from None
        if file_lines and file_lines[-1] == "":
            file_lines.pop()  # the newline that ends the last line starts no row
        lines += [line[:-1] if line.endswith("\r") else line for line in file_lines]
    return pa.table({"text": pa.array(lines, pa.string())})


def _first_bad(cells: list, start: int, allow_null: bool):
    for i, cell in enumerate(cells):
        if not isinstance(cell, str) and not (allow_null and cell is None):
            return start + i, "null" if cell is None else type(cell).__name__
    return None


def check_block(table, start: int, names: dict, where: str):
    """(problem, columns): problem (rank, row, message) for the block's first problem or None; columns
    the block's text, context and id cells by role. Ranks order problems as io.rows_of_columns meets them."""
    columns = {}
    if not table.column_names:  # an empty file (no row, so no column): as io.read_rows says it
        return (0, start, f"{where}: the file is empty: there are no rows to score"), None
    for rank, (flag, role) in enumerate(FLAGS):
        name = names[role]
        if name is not None and name not in table.column_names:
            return (0, rank, f"{where}: no column {name!r} ({flag}); the columns are: "
                             f"{', '.join(map(repr, table.column_names)) or '(none)'}"), None
        columns[role] = table.column(name).to_pylist() if name is not None else None
    for rank, role in ((1, "text"), (2, "context")):
        if columns[role] is not None:
            bad = _first_bad(columns[role], start, allow_null=role == "context")
            if bad:
                return (rank, bad[0], f"{where}: row {bad[0]} of column {names[role]!r} is {bad[1]}, not text"), None
    if columns["id"] is not None:
        for i, value in enumerate(columns["id"]):
            if value is None or isinstance(value, (list, dict)):
                kind = "null" if value is None else type(value).__name__
                return (3, start + i, f"{where}: row {start + i} of column {names['id']!r} is {kind}; "
                                      "an id must be text or a number"), None
        columns["id"] = [str(v) for v in columns["id"]]
    return None, columns


def index_block(block, start: int, done: list, names: dict, where: str, chunk_rows: list, buckets: int):
    """One input block -> [problem, *chunks to score, *id buckets]; see the module docstring."""
    import pyarrow as pa
    from ray.data.block import BlockAccessor

    table = BlockAccessor.for_block(block).to_arrow()
    problem, columns = check_block(table, start, names, where)
    if problem is not None:
        return [problem] + [None] * (len(chunk_rows) + buckets)
    n = table.num_rows
    indices = list(range(start, start + n))
    ids = columns["id"] or [str(i) for i in indices]
    contexts = columns["context"] or [None] * n
    id_buckets = [[[], []] for _ in range(buckets)]
    if buckets:
        for row_id, index in zip(ids, indices):
            bucket = id_buckets[_stable_hash(row_id) % buckets]
            bucket[0].append(row_id)
            bucket[1].append(index)
    keep = [k for k in range(n) if not _in_ranges(start + k, done)]
    keep.sort(key=lambda k: (contexts[k] or "", len(columns["text"][k]), k))
    chunks, at = [], 0
    for size in chunk_rows:
        rows = keep[at:at + size]
        at += size
        chunks.append(pa.table({INDEX: pa.array([indices[k] for k in rows], pa.int64()),
                                "id": pa.array([ids[k] for k in rows], pa.string()),
                                "text": pa.array([columns["text"][k] for k in rows], pa.string()),
                                "context": pa.array([contexts[k] or None for k in rows], pa.string())}))
    return [None] + chunks + [pa.table({"id": pa.array(b[0], pa.string()), INDEX: pa.array(b[1], pa.int64())})
                              for b in id_buckets]


def _stable_hash(text: str) -> int:
    import zlib

    return zlib.crc32(text.encode("utf-8"))  # hash() differs between processes


def _in_ranges(index: int, ranges: list) -> bool:
    return any(lo <= index < hi for lo, hi in ranges)


def first_duplicate(*tables):
    """(second row, first row, id) of the id seen twice soonest in input order, among one bucket's rows."""
    import pyarrow as pa

    table = pa.concat_tables([t for t in tables if t is not None])
    first: dict[str, int] = {}
    best = None
    for row_id, index in sorted(zip(table.column("id").to_pylist(), table.column(INDEX).to_pylist()),
                                key=lambda pair: pair[1]):
        if row_id in first:
            if best is None or index < best[0]:
                best = (index, first[row_id], row_id)
        else:
            first[row_id] = index
    return best


def ranges_of(done: set[int]) -> list[tuple[int, int]]:
    """Sorted row indices as [lo, hi) ranges: a scored chunk is a run of one block's rows."""
    out: list[list[int]] = []
    for index in sorted(done):
        if out and out[-1][1] == index:
            out[-1][1] += 1
        else:
            out.append([index, index + 1])
    return [tuple(r) for r in out]


def overlap(ranges: list, lo: int, hi: int) -> tuple[int, list]:
    """How many of rows [lo, hi) the ranges hold, and the ranges that touch them."""
    touching = [(a, b) for a, b in ranges if a < hi and b > lo]
    return sum(min(b, hi) - max(a, lo) for a, b in touching), touching


def prepare(input_path: str, files: list[str], kind: str, read_opts, done: set[int], chunk_rows: int,
            workers: int = 1):
    """Read and check the input on the cluster; (references to the chunks to score, rows in the input).
    Chunks hold at most `chunk_rows` rows, fewer when the rows would not give each of `workers` one.
    DatasetError, with the in-process job's message, for the input's first problem."""
    import ray

    names = {"text": read_opts.column or "text", "context": read_opts.context_column, "id": read_opts.id_column}
    check_options(input_path, kind, read_opts)
    blocks = _read_blocks(input_path, files, kind)
    num_rows = sum(n for _, n in blocks)
    ranges = ranges_of(done)
    pending = num_rows - overlap(ranges, 0, num_rows)[0]
    chunk_rows = max(1, min(chunk_rows, -(-pending // workers)))
    buckets = min(64, len(blocks)) if names["id"] else 0  # each bucket's ids in one task's memory
    index_task, problems, chunks, id_refs, start = ray.remote(index_block), [], [], [], 0
    for ref, n in blocks:
        held, touching = overlap(ranges, start, start + n)
        sizes = [min(chunk_rows, n - held - at) for at in range(0, n - held, chunk_rows)]
        outs = index_task.options(num_returns=1 + len(sizes) + buckets).remote(
            ref, start, touching, names, input_path, sizes, buckets)
        outs = outs if isinstance(outs, list) else [outs]
        problems.append(outs[0])
        chunks += outs[1:1 + len(sizes)]
        id_refs.append(outs[1 + len(sizes):])
        start += n
    del blocks  # the read blocks go once indexed: the chunks hold what is scored
    found = [p for p in ray.get(problems) if p is not None]
    if found:
        raise DatasetError(min(found)[2])
    if buckets and num_rows:
        duplicate_task = ray.remote(first_duplicate)
        found = [d for d in ray.get([duplicate_task.remote(*[refs[b] for refs in id_refs]) for b in range(buckets)])
                 if d is not None]
        if found:
            second, first, value = min(found)
            raise DatasetError(f"{input_path}: id {value!r} (column {names['id']!r}) is in rows {first} and "
                               f"{second}; ids must be unique")
    return chunks, num_rows


def _read_blocks(input_path: str, files: list[str], kind: str) -> list[tuple]:
    """(reference, rows) of each block Ray Data read, in input order; the driver holds no rows."""
    import ray.data

    context = ray.data.DataContext.get_current()
    kept_order = context.execution_options.preserve_order
    context.execution_options.preserve_order = True  # blocks in input order: the row indices rest on it
    context.enable_progress_bars = False  # the job prints its own
    context.print_on_execution_start = False
    try:
        return [(ref, meta.num_rows) for bundle in read(files, kind).iter_internal_ref_bundles()
                for ref, meta in zip(bundle.block_refs, bundle.metadata)]
    except Exception as exc:  # a reader's error (an unreadable file) comes wrapped by Ray
        raise DatasetError(f"cannot read {input_path}: {_reason(exc)}") from None
    finally:
        context.execution_options.preserve_order = kept_order


def _reason(exc: BaseException) -> str:
    """The first line of the innermost error Ray wrapped (a DatasetError raised in a worker: its message)."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "cause", None) or exc.__cause__
        if inner is None:
            break
        exc = inner
    if isinstance(exc, DatasetError):
        return exc.message
    text = str(exc).strip()
    return text.splitlines()[-1] if text else type(exc).__name__
