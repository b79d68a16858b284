"""The batch runner: a task on the server's event loop that leases lines of running batches from the
store and answers each through the app's pipeline (`api.pipeline.Pipeline.answer`: the same parse,
checks, hold and formatting as an HTTP request), as its key, at priority "batch" (admission and the
scheduler serve interactive requests first; a batch hold waits for its key's budget, never 429).

It keeps `in_flight` lines running so the engine stays busy, commits answers as they finish (several
lines per fsync), moves batches through their statuses (validating -> in_progress -> finalizing ->
completed; cancelling -> cancelled; expired at the end of the window) and deletes what is past its
retention. Behind `--replicas` the pipeline's backend sends each line to a replica; a line whose
replica was lost (503) is run again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time

import orjson

from ..api.errors import APIError, InternalError, error_body, new_request_id
from ..api.registry import BATCH_PATHS, BY_PATH
from ..api.serving.holding import Call
from ..backend import BATCH
from .metrics import BatchMetrics
from .routes import router
from .store import ACTIVE, Line, Result, Store, new_id

log = logging.getLogger("logprobe.batch")

LEASE_S = 30.0  # a line's lease; renewed every RENEW_S while it runs, so it lapses ~30 s after its runner died
RENEW_S = 5.0
SWEEP_S = 5.0  # expiry and retention checks
RETRY_S = 1.0  # before running again a line whose backend was lost (a replica died) or was rate-limited


def runner_name() -> str:
    """`runner:<host>:<pid>:<random>`: which process holds a lease, so a restart can tell its dead
    predecessor's leases (same host, no such process) from a live runner's."""
    return f"runner:{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def runner_is_dead(name: str) -> bool:
    """Whether the runner named so was a process of this host that no longer runs."""
    try:
        _, host, pid, _ = name.split(":")
        if host != socket.gethostname() or int(pid) == os.getpid():
            return False
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (ValueError, PermissionError, OSError):
        return False
    return False


def output_line(custom_id: str, request_id: str, status: int, body: bytes) -> bytes:
    """`{id, custom_id, response: {status_code, request_id, body}, error}` (the body spliced in as encoded)."""
    return (b'{"id":' + orjson.dumps(new_id("batch_req_")) + b',"custom_id":' + orjson.dumps(custom_id)
            + b',"response":{"status_code":' + str(status).encode() + b',"request_id":' + orjson.dumps(request_id)
            + b',"body":' + body + b'},"error":null}\n')


def unrun_line(code: str, message: str):
    """An error-file line for a line that never ran (`response` null)."""
    def line(custom_id: str) -> bytes:
        return orjson.dumps({"id": new_id("batch_req_"), "custom_id": custom_id, "response": None,
                             "error": {"code": code, "message": message}}) + b"\n"
    return line


EXPIRED = unrun_line("batch_expired", "This line was not run before the batch's completion window (24h) ended.")


class BatchRunner:
    def __init__(self, app, store: Store, batch_retention_s: float, in_flight: int = 128, lease_s: float = LEASE_S):
        self.pipeline = app.state.pipeline
        self.store = store
        self.batch_retention_s = batch_retention_s
        self.in_flight = in_flight
        self.lease_s = lease_s
        self.name = runner_name()  # this runner's leases
        self.endpoints = {path: BY_PATH[path].endpoint for path in BATCH_PATHS}
        self.tasks: dict[tuple[str, int], asyncio.Task] = {}
        self.results: list[Result] = []
        self._wake = asyncio.Event()
        self._written = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._writer_task: asyncio.Task | None = None
        self._swept = self._renewed = 0.0
        self.num_rounds = 0  # rounds done: one that starts after a change has seen it (what tests wait on)

    # ---- life ----------------------------------------------------------------------------------------

    def start(self) -> None:
        self.store.free_dead_leases(runner_is_dead)
        self._loop_task = asyncio.ensure_future(self._loop())
        self._writer_task = asyncio.ensure_future(self._writer())

    async def stop(self) -> None:
        """Stop running lines, commit the answers already made, give back the leases."""
        for task in [self._loop_task, *self.tasks.values()]:
            if task is not None:
                task.cancel()
        await asyncio.gather(self._loop_task, *self.tasks.values(), return_exceptions=True)
        if self._writer_task is not None:
            self._writer_task.cancel()
            await asyncio.gather(self._writer_task, return_exceptions=True)
        await self._flush()
        await asyncio.to_thread(self.store.unlease, self.name)

    def wake(self) -> None:
        self._wake.set()

    @property
    def draining(self) -> bool:
        return self.pipeline.admission.draining

    async def _loop(self) -> None:
        while True:
            try:
                await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("batch runner: a round failed; trying again")
            self.num_rounds += 1
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    async def _tick(self) -> None:
        if self.pipeline.backend is None:
            return  # the model is still loading
        now = time.monotonic()
        if now - self._swept >= SWEEP_S:
            self._swept = now
            await asyncio.to_thread(self.store.sweep_retention, self.batch_retention_s)
            await self._expire()
        await self._advance()
        if now - self._renewed >= RENEW_S and self.tasks:
            self._renewed = now
            await asyncio.to_thread(self.store.renew, self.name, self.lease_s)
        free = self.in_flight - len(self.tasks)
        # leases are taken a few at a time (one transaction each), not one per finished line
        if (free >= max(1, self.in_flight // 8) or not self.tasks) and not self.draining:
            for line in await asyncio.to_thread(self.store.claim, self.name, free, self.lease_s):
                key = (line.batch_id, line.idx)
                self.tasks[key] = task = asyncio.ensure_future(self._run_line(line))
                task.add_done_callback(lambda _, key=key: self._line_over(key))

    def _line_over(self, key) -> None:
        self.tasks.pop(key, None)
        self._wake.set()

    # ---- statuses ------------------------------------------------------------------------------------

    async def _advance(self) -> None:
        """Move every active batch as far as it goes now."""
        for batch in await asyncio.to_thread(self.store.batches_in, *ACTIVE):
            batch_id, status = batch["id"], batch["status"]
            mine = [t for (b, _), t in self.tasks.items() if b == batch_id]
            if status == "validating":
                missing = [name for name in (batch["model"] or "").split(", ") if name and not self._serves(name)]
                if missing:  # created before a restart that serves other models
                    await asyncio.to_thread(self.store.fail, batch_id, [{
                        "code": "model_not_found", "param": "model", "line": None,
                        "message": f"This server no longer serves the model {missing[0]!r} the batch's lines name."}])
                    continue
                await asyncio.to_thread(self.store.set_status, batch_id, "in_progress", ("validating",))
            elif status == "cancelling":
                for task in mine:
                    task.cancel()
                if not mine:
                    await asyncio.to_thread(self.store.finish, batch_id, "cancelled")
                    log.info("batch %s cancelled", batch_id)
            elif status == "in_progress" and not mine and not await asyncio.to_thread(self.store.pending_count,
                                                                                     batch_id):
                await self._flush()
                await asyncio.to_thread(self.store.set_status, batch_id, "finalizing", ("in_progress",))
                status = "finalizing"
            if status == "finalizing":
                await asyncio.to_thread(self.store.finish, batch_id, "completed")
                log.info("batch %s completed", batch_id)

    def _serves(self, name: str) -> bool:
        return any(name == b.info.name or name in b.info.aliases for b in self.pipeline.backends)

    async def _expire(self) -> None:
        """A batch past its window: its running lines stopped, the undone ones to the error file."""
        now = self.store.now()
        for batch in await asyncio.to_thread(self.store.batches_in, "validating", "in_progress", "cancelling"):
            if batch["expires_at"] > now:
                continue
            mine = [t for (b, _), t in self.tasks.items() if b == batch["id"]]
            for task in mine:
                task.cancel()
            await asyncio.gather(*mine, return_exceptions=True)
            await self._flush()
            if await asyncio.to_thread(self.store.finish, batch["id"], "expired", EXPIRED):
                log.info("batch %s expired", batch["id"])

    # ---- lines ---------------------------------------------------------------------------------------

    async def _run_line(self, line: Line) -> None:
        body = orjson.loads(line.body)
        endpoint = self.endpoints[line.endpoint]
        while True:
            call = Call(new_request_id(), line.owner, BATCH)  # never gone: cancelling the task stops it
            try:
                data, status = await self.pipeline.answer(endpoint, body, call), 200
            except APIError as exc:
                if exc.status == 503 and self.draining:
                    await asyncio.to_thread(self.store.unlease, self.name, [(line.batch_id, line.idx)])
                    return  # not answered: it runs after the restart
                if exc.status in (429, 503):  # rate-limited, or its replica was lost: run it again
                    if exc.status == 503:
                        log.info("batch line %s runs again: %s", call.request_id, exc.message)
                    await asyncio.sleep(float(exc.headers.get("retry-after", RETRY_S)))
                    continue
                data, status = error_body(exc.message, exc.type, exc.param, exc.code, call.request_id), exc.status
            except Exception:
                log.exception("batch line failed (%s)", call.request_id)
                exc = InternalError("The server had an error while processing your request.")
                data, status = error_body(exc.message, exc.type, None, exc.code, call.request_id), 500
            break
        self.results.append(Result(line.batch_id, line.idx, output_line(line.custom_id, call.request_id, status,
                                                                         data), status != 200))
        self._written.set()

    async def _writer(self) -> None:
        while True:
            await self._written.wait()
            self._written.clear()
            try:
                await self._flush()
            except Exception:
                log.exception("batch runner: committing answers failed; trying again")
                await asyncio.sleep(RETRY_S)
                self._written.set()

    async def _flush(self) -> None:
        """Commit every answer made so far (one transaction, one fsync per file)."""
        if not self.results:
            return
        results, self.results = self.results, []
        try:
            await asyncio.to_thread(self.store.commit, results)
        except BaseException:
            self.results[:0] = results
            raise
        self._wake.set()


def install(app, settings, clock=time.time) -> None:
    """The Batch API on an app (api/app.py): the store under `settings.data_dir`, the routes, the
    metrics; the app's lifespan starts and stops the runner."""
    store = Store(settings.data_dir, clock, settings.file_retention_days * 86400)
    app.state.batch_store = store
    app.state.batch_settings = settings
    app.state.batch_runner = None
    app.state.make_batch_runner = lambda: BatchRunner(app, store, settings.batch_retention_days * 86400)
    app.state.services.append((start_runner, stop_runner))
    app.include_router(router)
    app.state.metrics.registry.register(BatchMetrics(store))


async def start_runner(app) -> None:
    make = app.state.make_batch_runner
    if make is not None:
        app.state.batch_runner = make()
        app.state.batch_runner.start()


async def stop_runner(app) -> None:
    runner = app.state.batch_runner
    if runner is not None:
        await runner.stop()
