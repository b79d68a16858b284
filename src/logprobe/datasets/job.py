"""A resumable scoring job: a dataset file in, a result file out, safe to kill at any moment.

Rows are scored in chunks (sorted by context and length, so a chunk's rows are alike), two chunks in
flight so the engine never waits for a chunk to be written. Each finished chunk becomes one Parquet
file in `<output>.parts/`, written under a temporary name, fsync'd and renamed, so a part is either
whole or absent. A manifest there records the input (path, size, a hash of its first and last MiB)
and the options; the same command again skips the rows already in parts, and a different input or
options is refused. At the end the parts merge into `<output>` (temporary name, then rename) and the
parts directory goes. A SIGKILL loses at most the chunks in flight, and no row is ever written twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import inspect
import json
import os
import shutil
import uuid
from dataclasses import dataclass

from ..client.http import run_sync
from . import columns, progress as progress_mod
from .io import DatasetError, format_of, read_rows, require_data_extra

INDEX = "__row_index"  # the row's position in the input, kept in the parts only
MANIFEST = "manifest.json"
IN_FLIGHT = 2  # chunks scored at once: one runs while the one before is written


@dataclass(frozen=True)
class ReadOptions:
    column: str = "text"
    context_column: str | None = None
    id_column: str | None = None
    messages_column: str | None = None
    ids_column: str | None = None


def chunks(prepared: list, max_rows: int = 256, max_tokens: int = 32_768) -> list[list]:
    """Prepared rows sorted by context and length, cut into chunks of at most `max_rows` rows and about
    `max_tokens` tokens (a longer row is a chunk of its own)."""
    def size(p):
        return p.num_tokens or len(p.row.text) // 4 + 1

    ordered = sorted(prepared, key=lambda p: (p.row.context or "", size(p)))
    out, current, tokens = [], [], 0
    for p in ordered:
        if current and (len(current) >= max_rows or tokens + size(p) > max_tokens):
            out.append(current)
            current, tokens = [], 0
        current.append(p)
        tokens += size(p)
    if current:
        out.append(current)
    return out


async def score_chunks(scorer, pieces: list[list], on_chunk, depth: int = IN_FLIGHT, on_rows=None) -> None:
    """Score chunks, `depth` at a time; `on_chunk(chunk, records)` as each finishes, in finishing order;
    `on_rows(rows, tokens)` as rows come back: as the scorer reports them where its `run` takes `on_rows`
    (a remote scorer: each request's rows), else a chunk's rows when it finishes."""
    queue = list(pieces)
    running: set[asyncio.Task] = set()
    owner: dict[asyncio.Task, list] = {}
    reports = on_rows is not None and "on_rows" in inspect.signature(scorer.run).parameters
    try:
        while queue or running:
            while queue and len(running) < depth:
                chunk = queue.pop(0)
                task = asyncio.ensure_future(scorer.run(chunk, on_rows=on_rows) if reports else scorer.run(chunk))
                running.add(task)
                owner[task] = chunk
            done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                chunk, records = owner.pop(task), task.result()
                on_chunk(chunk, records)
                if on_rows is not None and not reports:
                    on_rows(len(chunk), sum(r.get("num_tokens") or 0 for r in records))
    finally:
        for task in running:
            task.cancel()


def run(input_path: str, output_path: str, scorer, options: columns.ScoreOptions,
        read_opts: ReadOptions = ReadOptions(), resume: bool = True, progress: str = "auto",
        max_rows: int = 256, max_tokens: int = 32_768) -> int:
    """Score `input_path` into `output_path` (format by extension: .parquet, .jsonl, .csv). Returns
    the number of rows written. A `DatasetError` leaves no output file. `scorer`: an InProcessScorer or
    RemoteScorer, or a function that makes one (called once the input has been read and checked, so a
    bad file is refused before a model loads; what it makes is closed at the end)."""
    require_data_extra()
    out_format = format_of(output_path)
    if out_format == "txt":
        raise DatasetError(f"{output_path}: the output is .parquet, .jsonl or .csv")
    out_dir = os.path.dirname(os.path.abspath(output_path))
    if not os.path.isdir(out_dir):
        raise DatasetError(f"cannot write {output_path}: no directory {out_dir}")
    rows = read_rows(input_path, **dataclasses.asdict(read_opts))
    if not rows:
        write_table(columns.to_table([], options), output_path, out_format)
        return 0
    made = not hasattr(scorer, "run")
    if made:
        scorer = scorer()
    parts = Parts(output_path + ".parts", manifest_of(input_path, scorer, options, read_opts))
    try:
        done = parts.open(resume)
        pending = [r for r in rows if r.index not in done]
        prepared = scorer.prepare(pending)
        scorer.refuse_invalid(prepared)
        parts.create()
        bar = progress_mod.make(progress, len(rows), len(rows) - len(pending))

        def on_chunk(chunk, records):
            parts.write([p.row.index for p in chunk], columns.to_table(records, options))

        try:
            run_sync(score_chunks(scorer, chunks(prepared, max_rows, max_tokens), on_chunk, on_rows=bar.update))
        finally:
            bar.close()
        table = parts.merged(len(rows))
        write_table(table, output_path, out_format)
        parts.remove()
        return table.num_rows
    finally:
        parts.release()
        if made:
            scorer.close()


def manifest_of(input_path: str, scorer, options, read_opts: ReadOptions) -> dict:
    """What a set of parts was made from: a resume must read the same input with the same options."""
    return {"input": os.path.abspath(input_path), "input_size": os.path.getsize(input_path),
            "input_sha256": fingerprint(input_path), "model": getattr(scorer, "model_name", None),
            "options": dataclasses.asdict(options), "read": dataclasses.asdict(read_opts)}


def fingerprint(path: str, span: int = 2**20) -> str:
    """sha256 of the whole file up to 2 MiB, else of its first and last MiB (and its size)."""
    digest = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        if size <= 2 * span:
            digest.update(fh.read())
        else:
            digest.update(fh.read(span))
            fh.seek(size - span)
            digest.update(fh.read(span))
            digest.update(str(size).encode())
    return digest.hexdigest()


class Parts:
    """The chunks written so far, one Parquet file each, in `<output>.parts/`."""

    def __init__(self, path: str, manifest: dict):
        self.path, self.manifest = path, manifest
        self._lock = None

    def open(self, resume: bool) -> set[int]:
        """The rows already done (none without parts or without `resume`); refuses other input/options."""
        if not os.path.isdir(self.path):
            return set()
        self._take_lock()
        if not resume:
            self.remove()
            return set()
        try:
            with open(os.path.join(self.path, MANIFEST), encoding="utf-8") as fh:
                found = json.load(fh)
        except FileNotFoundError:
            if not self._part_names():  # a job killed between making the directory and its manifest
                self.release()
                self.remove()
                return set()
            found = None
        except (OSError, ValueError):
            found = None
        if found != self.manifest:
            raise DatasetError(f"{self.path} holds rows scored from other input or with other options; "
                               "remove it, give another --output, or pass --no-resume to start over")
        return set(self._read_indices())

    def create(self) -> None:
        if not os.path.isdir(self.path):
            os.makedirs(self.path)
            self._take_lock()
            _write_atomic(os.path.join(self.path, MANIFEST), json.dumps(self.manifest, indent=1).encode())

    def write(self, indices: list[int], table) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = table.append_column(INDEX, pa.array(indices, type=pa.int64()))
        tmp = os.path.join(self.path, f".tmp-{uuid.uuid4().hex}.parquet")
        pq.write_table(table, tmp)
        _fsync_rename(tmp, os.path.join(self.path, f"part-{min(indices):09d}-{uuid.uuid4().hex[:8]}.parquet"))

    def merged(self, num_rows: int):
        """Every part's rows, in input order, each row once; checks that every row is there."""
        import pyarrow as pa
        import pyarrow.compute as pc

        tables = [self._read(name) for name in self._part_names()]
        if not tables:
            raise RuntimeError(f"no parts in {self.path}")
        table = pa.concat_tables(tables)
        table = table.take(pc.sort_indices(table, [(INDEX, "ascending")]))
        indices = table.column(INDEX).to_numpy()
        keep = [0] + [i for i in range(1, len(indices)) if indices[i] != indices[i - 1]]
        table = table.take(pa.array(keep, type=pa.int64()))
        if table.num_rows != num_rows:
            raise RuntimeError(f"the parts hold {table.num_rows} of {num_rows} rows")
        return table.drop_columns([INDEX])

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def release(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def _take_lock(self) -> None:
        import fcntl

        if self._lock is not None:
            return
        self._lock = os.open(self.path, os.O_RDONLY)  # the directory itself: nothing is left behind
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.release()
            raise DatasetError(f"another logprobe score is writing {self.path}") from None

    def _part_names(self) -> list[str]:
        for name in os.listdir(self.path):
            if name.startswith(".tmp-"):  # a chunk being written when the job died: never renamed, not a part
                os.unlink(os.path.join(self.path, name))
        return sorted(n for n in os.listdir(self.path) if n.startswith("part-") and n.endswith(".parquet"))

    def _read(self, name: str):
        import pyarrow.parquet as pq

        return pq.read_table(os.path.join(self.path, name))

    def _read_indices(self) -> list[int]:
        import pyarrow.parquet as pq

        out = []
        for name in self._part_names():
            out += pq.read_table(os.path.join(self.path, name), columns=[INDEX]).column(0).to_pylist()
        return out


def write_table(table, path: str, fmt: str) -> None:
    """Write a result table as Parquet, JSON lines or CSV (a list cell as its JSON text), atomically."""
    import pyarrow as pa

    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            pq.write_table(table, tmp)
        elif fmt == "jsonl":
            import orjson

            with open(tmp, "wb") as fh:
                for record in table.to_pylist():
                    fh.write(orjson.dumps(record) + b"\n")
        else:
            import orjson
            import pyarrow.csv as pacsv

            for i, field in enumerate(table.schema):
                if pa.types.is_list(field.type):
                    cells = [None if v is None else orjson.dumps(v).decode() for v in table.column(i).to_pylist()]
                    table = table.set_column(i, field.name, pa.array(cells, type=pa.string()))
            pacsv.write_csv(table, tmp)
        _fsync_rename(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    with open(tmp, "wb") as fh:
        fh.write(data)
    _fsync_rename(tmp, path)


def _fsync_rename(tmp: str, path: str) -> None:
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
