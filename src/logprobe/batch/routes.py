"""The Batch API's routes: `/v1/files` and `/v1/batches` in OpenAI's shapes. A key sees only its own
files and batches: another key's id answers 404, the same as a missing one. The store's calls run in
a worker thread (a commit waits for fsync)."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.responses import FileResponse

from ..api.errors import InvalidRequest
from ..api.shell.json_body import json_response, read_json
from .files import BatchBody, WINDOW_S, batch_lines, batch_object, file_object, no_such, page, read_batch_file

router = APIRouter()
# python-multipart warns about the CRLF the openai SDK sends after a form's last boundary: every upload
logging.getLogger("python_multipart.multipart").setLevel(logging.ERROR)
FORM_SLACK = 64 * 1024  # multipart headers and the `purpose` field around the file's bytes


def store_of(request: Request):
    return request.app.state.batch_store


def owner_of(request: Request) -> str:
    return request.state.key_id


def int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequest(f"Invalid type for '{name}': expected an integer.", name) from None
    if not low <= value <= high:
        raise InvalidRequest(f"Invalid value for '{name}': expected a value from {low} to {high}.", name)
    return value


@router.post("/v1/files", openapi_extra={"requestBody": {"required": True, "content": {"multipart/form-data": {
    "schema": {"type": "object", "required": ["file", "purpose"], "properties": {
        "file": {"type": "string", "format": "binary"}, "purpose": {"type": "string", "enum": ["batch"]}}}}}}})
async def upload_file(request: Request):
    """Upload a batch input file (multipart form: `file`, `purpose` "batch"): JSONL, one request a line,
    checked now; at most `max_file_bytes`."""
    limit = request.app.state.batch_settings.max_file_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit + FORM_SLACK:
        raise InvalidRequest(too_big(int(declared), limit), "file")
    try:
        form = await request.form(max_files=1, max_fields=8)
    except Exception:
        raise InvalidRequest("The body must be a multipart form with the fields 'file' and 'purpose'.",
                             "file") from None
    try:
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "batch":
            raise InvalidRequest("Invalid value for 'purpose': this server takes files of purpose 'batch'.",
                                 "purpose")
        if not isinstance(upload, UploadFile):
            raise InvalidRequest("The form has no file: send it as the field 'file'.", "file")
        data = await upload.read(limit + 1)
        if len(data) > limit:
            raise InvalidRequest(too_big(None, limit), "file")
        filename = upload.filename or "batch.jsonl"
    finally:
        await form.close()
    await run_in_threadpool(read_batch_file, data)
    row = await run_in_threadpool(store_of(request).add_file, owner_of(request), filename, "batch", data)
    return json_response(file_object(row))


def too_big(size: int | None, limit: int) -> str:
    said = f"{size} bytes, " if size is not None else ""
    return f"The file is {said}over this server's cap of {limit} bytes (max_file_bytes)."


@router.get("/v1/files")
async def list_files(request: Request):
    """Your files, newest first (`order=asc`: oldest first), `limit` at a time after the file `after`."""
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("Invalid value for 'order': expected 'asc' or 'desc'.", "order")
    rows, more = await run_in_threadpool(store_of(request).list_files, owner_of(request),
                                         request.query_params.get("purpose"), request.query_params.get("after"),
                                         int_param(request, "limit", 10_000, 1, 10_000), order == "desc")
    return json_response(page([file_object(r) for r in rows], more))


async def own_file(request: Request, file_id: str) -> dict:
    row = await run_in_threadpool(store_of(request).get_file, owner_of(request), file_id)
    if row is None:
        raise no_such("file", file_id)
    return row


@router.get("/v1/files/{file_id}")
async def retrieve_file(request: Request, file_id: str):
    """One of your files."""
    return json_response(file_object(await own_file(request, file_id)))


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str):
    """A file's bytes: an input file as uploaded, a batch's output or error file (JSONL)."""
    row = await own_file(request, file_id)
    return FileResponse(store_of(request).path(row["id"]), media_type="application/octet-stream",
                        filename=row["filename"])


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str):
    """Delete one of your files (a batch already created from it keeps its lines)."""
    if not await run_in_threadpool(store_of(request).delete_file, owner_of(request), file_id):
        raise no_such("file", file_id)
    return json_response({"id": file_id, "object": "file", "deleted": True})


@router.post("/v1/batches", openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
    "schema": BatchBody.model_json_schema()}}}})
async def create_batch(request: Request):
    """Run every line of an uploaded file through `endpoint`, in the capacity requests leave; the answers
    go to the batch's output file (errors to its error file) as lines finish."""
    limits = request.app.state.limits
    body = BatchBody.parse(await read_json(request, limits), limits)
    store, owner = store_of(request), owner_of(request)
    source = await run_in_threadpool(store.get_file, owner, body.input_file_id)
    if source is None or source["purpose"] != "batch":
        raise no_such("file", body.input_file_id, "input_file_id")
    data = await run_in_threadpool(store.path(source["id"]).read_bytes)
    model, lines = await run_in_threadpool(batch_lines, data, body.endpoint,
                                           request.app.state.pipeline.resolve_model,
                                           request.app.state.batch_settings.max_batch_lines)
    row = await run_in_threadpool(store.add_batch, owner, body.endpoint, source["id"], model, body.metadata,
                                  lines, WINDOW_S)
    runner = request.app.state.batch_runner
    if runner is not None:
        runner.wake()
    return json_response(batch_object(row))


async def own_batch(request: Request, batch_id: str) -> dict:
    row = await run_in_threadpool(store_of(request).get_batch, owner_of(request), batch_id)
    if row is None:
        raise no_such("batch", batch_id)
    return row


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(request: Request, batch_id: str):
    """One of your batches: its status and `request_counts` as lines finish."""
    return json_response(batch_object(await own_batch(request, batch_id)))


@router.get("/v1/batches")
async def list_batches(request: Request):
    """Your batches, newest first, `limit` (1-100, default 20) at a time after the batch `after`."""
    rows, more = await run_in_threadpool(store_of(request).list_batches, owner_of(request),
                                         request.query_params.get("after"), int_param(request, "limit", 20, 1, 100))
    return json_response(page([batch_object(r) for r in rows], more))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str):
    """Stop a batch: `cancelling` at once, `cancelled` when its running lines are stopped; the lines
    already answered stay in its output file."""
    row = await own_batch(request, batch_id)
    store = store_of(request)
    moved = await run_in_threadpool(store.set_status, batch_id, "cancelling", ("validating", "in_progress"))
    if not moved and row["status"] not in ("cancelling", "cancelled"):
        raise InvalidRequest(f"The batch is {row['status']}: only a validating or in-progress batch can be "
                             "cancelled.", "batch_id", status=409, code="conflict")
    runner = request.app.state.batch_runner
    if runner is not None:
        runner.wake()
    return json_response(batch_object(await own_batch(request, batch_id)))
