"""The durable state of the Batch API: one SQLite database (the standard library's, WAL mode) under
`--data-dir`, with the files' bytes beside it in `files/`.

Tables: `files` (uploaded and finished output files), `batches` (one row per batch, its status, counts
and the committed length of its output and error files) and `lines` (each input line, its state and
its lease). What makes a SIGKILL at any moment harmless:

- a line's answer is appended to its batch's output (or error) file and fsynced *inside* the SQLite
  write transaction that marks the line done and moves the batch's committed length; before appending,
  the file is cut back to its committed length. A crash after the append and before the commit leaves
  a longer file and a line not done: the next append cuts the tail off and the line runs again. So
  every line is in the output exactly once;
- the write transaction (`BEGIN IMMEDIATE`) is SQLite's one writer lock, across processes too, so two
  runners (a restart, two ingress replicas) never append to one file at once;
- a runner leases the lines it runs (`lease_owner`, `lease_until`, renewed while it runs them); a lease
  that was not renewed (its runner died) lapses and another runner takes the line;
- a finished batch's output files are registered, and its status set, in one transaction.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL = ("completed", "failed", "expired", "cancelled")

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER, seq INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, seq INTEGER NOT NULL, endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL, model TEXT, completion_window TEXT NOT NULL, status TEXT NOT NULL,
    metadata TEXT, errors TEXT, created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
    expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    out_id TEXT NOT NULL, err_id TEXT NOT NULL,           -- the output files' ids, allocated up front
    output_file_id TEXT, error_file_id TEXT,              -- set once those files are registered
    output_bytes INTEGER NOT NULL DEFAULT 0, error_bytes INTEGER NOT NULL DEFAULT 0,  -- committed lengths
    total INTEGER NOT NULL, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL, body BLOB NOT NULL,
    sort_ctx TEXT NOT NULL, sort_len INTEGER NOT NULL, state TEXT NOT NULL DEFAULT 'pending',
    lease_owner TEXT, lease_until REAL, PRIMARY KEY (batch_id, idx));
CREATE INDEX IF NOT EXISTS lines_order ON lines (batch_id, state, sort_ctx, sort_len);
CREATE INDEX IF NOT EXISTS lines_lease ON lines (lease_owner);
CREATE INDEX IF NOT EXISTS batches_owner ON batches (owner, seq);
CREATE INDEX IF NOT EXISTS files_owner ON files (owner, seq);
"""


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


@dataclass
class Line:
    """A leased line: what the runner needs to answer it."""

    batch_id: str
    idx: int
    custom_id: str
    body: bytes
    owner: str
    endpoint: str


@dataclass
class Result:
    """A line's answer, ready to be committed: one JSON line of the output (`is_error` False) or
    error file."""

    batch_id: str
    idx: int
    data: bytes  # the JSON line, newline included
    is_error: bool


class Store:
    """The files, batches and lines. Thread-safe (one connection behind a lock); each public method is one
    short transaction. `clock` gives Unix seconds (tests move it)."""

    def __init__(self, data_dir: str | os.PathLike, clock=time.time, file_retention_s: float = 30 * 86400.0):
        self.root = Path(data_dir)
        self.file_retention_s = file_retention_s  # of the output files a finished batch registers
        self.files_dir = self.root / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.root / "batches.sqlite3", isolation_level=None, check_same_thread=False,
                                   timeout=60)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a commit is on disk when it returns
        with self._lock:
            self._db.executescript(SCHEMA)  # idempotent (IF NOT EXISTS); it commits by itself

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def _write(self):
        """One write transaction, SQLite's writer lock held from its start (across processes too)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _read(self, sql: str, args=()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def now(self) -> int:
        return int(self.clock())

    # ---- files -------------------------------------------------------------------------------------

    def add_file(self, owner: str, filename: str, purpose: str, data: bytes) -> dict:
        """Save the bytes (written, fsynced, then renamed into place) and register the file."""
        file_id = new_id("file-")
        tmp = self.files_dir / (file_id + ".part")
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path(file_id))
        created = self.now()
        with self._write() as db:
            seq = db.execute("SELECT coalesce(max(seq), 0) + 1 FROM files").fetchone()[0]
            db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       (file_id, owner, purpose, filename, len(data), created, created + int(self.file_retention_s), seq))
        return self.get_file(owner, file_id)

    def get_file(self, owner: str, file_id: str) -> dict | None:
        rows = self._read("SELECT * FROM files WHERE id = ? AND owner = ?", (file_id, owner))
        return dict(rows[0]) if rows else None

    def list_files(self, owner: str, purpose: str | None, after: str | None, limit: int, newest_first: bool):
        """(files, has_more): the owner's files in creation order (newest first by default), after the
        file `after` (None: from the start)."""
        where, args = ["owner = ?"], [owner]
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        if after is not None:  # an unknown `after` lists nothing
            where.append(f"seq {'<' if newest_first else '>'} coalesce((SELECT seq FROM files WHERE id = ? "
                         f"AND owner = ?), {0 if newest_first else 'NULL'})")
            args += [after, owner]
        rows = self._read(f"SELECT * FROM files WHERE {' AND '.join(where)} ORDER BY seq "
                          f"{'DESC' if newest_first else 'ASC'} LIMIT ?", (*args, limit + 1))
        return [dict(r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, owner: str, file_id: str) -> bool:
        with self._write() as db:
            gone = db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)).rowcount
        if gone:
            self.path(file_id).unlink(missing_ok=True)
        return bool(gone)

    # ---- batches -----------------------------------------------------------------------------------

    def add_batch(self, owner: str, endpoint: str, input_file_id: str, model: str | None, metadata: dict | None,
                  lines: list[tuple[str, bytes, str, int]], window_s: int) -> dict:
        """A new batch (`validating`) and its lines: (custom_id, body, sort_ctx, sort_len) each."""
        batch_id, created = new_id("batch_"), self.now()
        with self._write() as db:
            seq = db.execute("SELECT coalesce(max(seq), 0) + 1 FROM batches").fetchone()[0]
            db.execute("INSERT INTO batches (id, owner, seq, endpoint, input_file_id, model, completion_window, "
                       "status, metadata, created_at, expires_at, out_id, err_id, total) "
                       "VALUES (?, ?, ?, ?, ?, ?, '24h', 'validating', ?, ?, ?, ?, ?, ?)",
                       (batch_id, owner, seq, endpoint, input_file_id, model,
                        None if metadata is None else orjson.dumps(metadata).decode(), created, created + window_s,
                        new_id("file-"), new_id("file-"), len(lines)))
            db.executemany("INSERT INTO lines (batch_id, idx, custom_id, body, sort_ctx, sort_len) "
                           "VALUES (?, ?, ?, ?, ?, ?)",
                           [(batch_id, i, *line) for i, line in enumerate(lines)])
        return self.get_batch(owner, batch_id)

    def get_batch(self, owner: str | None, batch_id: str) -> dict | None:
        """The batch (None: missing, or another owner's; `owner` None: any owner's, for the runner)."""
        sql, args = "SELECT * FROM batches WHERE id = ?", [batch_id]
        if owner is not None:
            sql, args = sql + " AND owner = ?", [batch_id, owner]
        rows = self._read(sql, args)
        return dict(rows[0]) if rows else None

    def list_batches(self, owner: str, after: str | None, limit: int):
        """(batches, has_more): the owner's batches, newest first, after the batch `after`."""
        args: list = [owner]
        where = "owner = ?"
        if after is not None:
            where += " AND seq < coalesce((SELECT seq FROM batches WHERE id = ? AND owner = ?), 0)"
            args += [after, owner]
        rows = self._read(f"SELECT * FROM batches WHERE {where} ORDER BY seq DESC LIMIT ?", (*args, limit + 1))
        return [dict(r) for r in rows[:limit]], len(rows) > limit

    def set_status(self, batch_id: str, status: str, only_from: tuple[str, ...]) -> bool:
        """Move a batch to `status` (stamping `<status>_at`) if it is in one of `only_from`."""
        with self._write() as db:
            marks = ",".join("?" * len(only_from))
            return bool(db.execute(f"UPDATE batches SET status = ?, {status}_at = ? WHERE id = ? AND status IN "
                                   f"({marks})", (status, self.now(), batch_id, *only_from)).rowcount)

    def fail(self, batch_id: str, errors: list[dict]) -> None:
        with self._write() as db:
            db.execute("UPDATE batches SET status = 'failed', failed_at = ?, errors = ? WHERE id = ? AND status IN "
                       "('validating', 'in_progress')", (self.now(), orjson.dumps(errors).decode(), batch_id))

    def batches_in(self, *statuses: str) -> list[dict]:
        marks = ",".join("?" * len(statuses))
        return [dict(r) for r in self._read(f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY seq",
                                            statuses)]

    def pending_count(self, batch_id: str) -> int:
        return self._read("SELECT count(*) FROM lines WHERE batch_id = ? AND state = 'pending'", (batch_id,))[0][0]

    # ---- lines -------------------------------------------------------------------------------------

    def claim(self, runner: str, limit: int, lease_s: float) -> list[Line]:
        """Lease up to `limit` lines nobody holds, of running batches, oldest batch first and, within a
        batch, shared contexts together and shortest first (the engine's order, not the file's)."""
        now = self.clock()
        with self._write() as db:
            rows = db.execute(
                "SELECT l.batch_id, l.idx, l.custom_id, l.body, b.owner, b.endpoint FROM batches b "
                "JOIN lines l ON l.batch_id = b.id WHERE b.status = 'in_progress' AND l.state = 'pending' "
                "AND (l.lease_until IS NULL OR l.lease_until < ?) ORDER BY b.seq, l.sort_ctx, l.sort_len, l.idx "
                "LIMIT ?", (now, limit)).fetchall()
            db.executemany("UPDATE lines SET lease_owner = ?, lease_until = ? WHERE batch_id = ? AND idx = ?",
                           [(runner, now + lease_s, r["batch_id"], r["idx"]) for r in rows])
        return [Line(r["batch_id"], r["idx"], r["custom_id"], bytes(r["body"]), r["owner"], r["endpoint"])
                for r in rows]

    def renew(self, runner: str, lease_s: float) -> None:
        with self._write() as db:
            db.execute("UPDATE lines SET lease_until = ? WHERE lease_owner = ? AND state = 'pending'",
                       (self.clock() + lease_s, runner))

    def unlease(self, runner: str, keys: list[tuple[str, int]] | None = None) -> None:
        """Give back leases (all of the runner's when `keys` is None): those lines run again, anywhere."""
        with self._write() as db:
            if keys is None:
                db.execute("UPDATE lines SET lease_owner = NULL, lease_until = NULL WHERE lease_owner = ?", (runner,))
            else:
                db.executemany("UPDATE lines SET lease_owner = NULL, lease_until = NULL WHERE batch_id = ? AND "
                               "idx = ? AND lease_owner = ?", [(b, i, runner) for b, i in keys])

    def free_dead_leases(self, is_dead) -> int:
        """Give back the leases of runners `is_dead(runner)` says are gone (a restarted server frees its
        killed predecessor's lines at once, instead of waiting for their leases to lapse)."""
        owners = [r[0] for r in self._read("SELECT DISTINCT lease_owner FROM lines WHERE lease_owner IS NOT NULL "
                                           "AND state = 'pending'")]
        dead = [o for o in owners if is_dead(o)]
        with self._write() as db:
            db.executemany("UPDATE lines SET lease_owner = NULL, lease_until = NULL WHERE lease_owner = ?",
                           [(o,) for o in dead])
        return len(dead)

    def commit(self, results: list[Result]) -> int:
        """Append the answers of lines still pending to their batches' files (fsynced) and mark them done,
        in one transaction; answers of lines already done, or of batches no longer running, are dropped.
        Returns how many were written."""
        written = 0
        with self._write() as db:
            for batch_id in dict.fromkeys(r.batch_id for r in results):
                batch = db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
                if batch is None or batch["status"] not in ("in_progress", "cancelling"):
                    continue
                fresh, seen = [], set()
                for r in results:
                    if r.batch_id != batch_id or r.idx in seen:
                        continue
                    state = db.execute("SELECT state FROM lines WHERE batch_id = ? AND idx = ?",
                                       (batch_id, r.idx)).fetchone()
                    if state is not None and state[0] == "pending":
                        fresh.append(r)
                        seen.add(r.idx)
                outputs = [r for r in fresh if not r.is_error]
                errors = [r for r in fresh if r.is_error]
                out_len = append(self.path(batch["out_id"]), batch["output_bytes"], b"".join(r.data for r in outputs))
                err_len = append(self.path(batch["err_id"]), batch["error_bytes"], b"".join(r.data for r in errors))
                db.executemany("UPDATE lines SET state = ?, lease_owner = NULL, lease_until = NULL "
                               "WHERE batch_id = ? AND idx = ?",
                               [("failed" if r.is_error else "done", batch_id, r.idx) for r in fresh])
                db.execute("UPDATE batches SET output_bytes = ?, error_bytes = ?, completed = completed + ?, "
                           "failed = failed + ? WHERE id = ?", (out_len, err_len, len(outputs), len(errors), batch_id))
                written += len(fresh)
        return written

    def finish(self, batch_id: str, status: str, undone_error=None) -> bool:
        """End a batch: `completed` (from finalizing), `cancelled` (from cancelling) or `expired`. With
        `undone_error` (custom_id -> JSON line), every line not done goes to the error file first. The
        output files are cut to their committed lengths and registered, and the status set, at once."""
        now = self.now()
        with self._write() as db:
            batch = db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if batch is None or batch["status"] in TERMINAL:
                return False
            out_len, err_len, failed = batch["output_bytes"], batch["error_bytes"], batch["failed"]
            if undone_error is not None:
                undone = db.execute("SELECT idx, custom_id FROM lines WHERE batch_id = ? AND state = 'pending' "
                                    "ORDER BY idx", (batch_id,)).fetchall()
                err_len = append(self.path(batch["err_id"]), err_len,
                                 b"".join(undone_error(r["custom_id"]) for r in undone))
                db.execute("UPDATE lines SET state = 'failed', lease_owner = NULL WHERE batch_id = ? AND "
                           "state = 'pending'", (batch_id,))
                failed += len(undone)
            ids = {}
            for column, file_id, length in (("output_file_id", batch["out_id"], out_len),
                                            ("error_file_id", batch["err_id"], err_len)):
                cut(self.path(file_id), length)
                if length:
                    seq = db.execute("SELECT coalesce(max(seq), 0) + 1 FROM files").fetchone()[0]
                    db.execute("INSERT OR IGNORE INTO files VALUES (?, ?, 'batch_output', ?, ?, ?, ?, ?)",
                               (file_id, batch["owner"], f"{batch_id}_{column[:-8]}.jsonl", length, now,
                                now + int(self.file_retention_s), seq))
                    ids[column] = file_id
            db.execute(f"UPDATE batches SET status = ?, {status}_at = ?, output_file_id = ?, error_file_id = ?, "
                       "error_bytes = ?, failed = ? WHERE id = ?",
                       (status, now, ids.get("output_file_id"), ids.get("error_file_id"), err_len, failed, batch_id))
        return True

    # ---- retention and metrics ---------------------------------------------------------------------

    def sweep_retention(self, batch_retention_s: float) -> None:
        """Delete expired files (rows, then bytes) and finished batches past their retention."""
        now = self.now()
        with self._write() as db:
            gone = [r[0] for r in db.execute("SELECT id FROM files WHERE expires_at <= ?", (now,))]
            db.execute("DELETE FROM files WHERE expires_at <= ?", (now,))
            old = db.execute(
                f"SELECT id, out_id, err_id FROM batches WHERE created_at + ? <= ? AND status IN "
                f"({','.join('?' * len(TERMINAL))})", (batch_retention_s, now, *TERMINAL)).fetchall()
            for batch_id, out_id, err_id in old:
                db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
                db.execute("DELETE FROM batches WHERE id = ?", (batch_id,))
                registered = {r[0] for r in db.execute("SELECT id FROM files WHERE id IN (?, ?)", (out_id, err_id))}
                gone += [f for f in (out_id, err_id) if f not in registered]  # never registered: only bytes
        for file_id in gone:
            self.path(file_id).unlink(missing_ok=True)

    def totals(self) -> tuple[dict[str, int], int, int]:
        """({status: batches}, lines done, lines failed) over every owner, for /metrics (no owner in them)."""
        by_status = {r[0]: r[1] for r in self._read("SELECT status, count(*) FROM batches GROUP BY status")}
        done, failed = self._read("SELECT coalesce(sum(completed), 0), coalesce(sum(failed), 0) FROM batches")[0]
        return by_status, done, failed


def append(path: Path, committed: int, data: bytes) -> int:
    """Write `data` at the committed end of the file (cutting off whatever a crashed writer left past
    it) and fsync; the new committed length."""
    if not data and not committed and not path.exists():
        return 0  # nothing to write: no empty file
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        size = os.fstat(fd).st_size
        if size < committed:
            raise OSError(f"{path} is shorter ({size} bytes) than its committed length ({committed})")
        if size > committed:
            os.ftruncate(fd, committed)
        if data:
            os.lseek(fd, committed, os.SEEK_SET)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        if data or size > committed:
            os.fsync(fd)
    finally:
        os.close(fd)
    return committed + len(data)


def cut(path: Path, length: int) -> None:
    """The file at exactly its committed length (absent when that is 0)."""
    if not length:
        path.unlink(missing_ok=True)
        return
    append(path, length, b"")
