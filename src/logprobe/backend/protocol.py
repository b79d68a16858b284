"""The `Backend` protocol (what the API asks of a model server), the `ModelInfo` it describes its model
with, and the errors it raises."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ..tokens import TokenTable
from .outputs import Delta, GenerationOutput, StreamEnd
from .requests import GenerationRequest


@dataclass
class ModelInfo:
    """What the API tells about the served model."""

    name: str
    aliases: list[str]
    num_layers: int
    d_model: int
    vocab_size: int
    context_length: int
    dtype: str
    bos_token: str | None
    eos_token: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    adds_bos: bool
    has_chat_template: bool
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    quantization: str | None = None  # "int4": decode steps read 4-bit weights
    runner: str = "transformers"  # "lean": logprobe's own batched forward; "transformers": the model's own


# ---- the backend ---------------------------------------------------------------------------------


class RequestAborted(Exception):
    """The request was stopped by `Backend.abort` before it finished."""


class RequestConflict(Exception):
    """The request's own settings leave nothing to generate, found only while it runs (its masks allow no
    token at some position: `allowed_token_ids`, `bad_words`, a constraint and `min_tokens` disagree).
    The request's fault, not the backend's: the API answers 400 with `message`, naming the fields, and
    the engine does not count it as a failure."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message, param)  # both in `args`: it pickles across a process (Ray Serve)
        self.message = message
        self.param = param

    def __str__(self) -> str:
        return self.message


class BackendUnavailable(Exception):
    """The backend could not run a request for a reason of its own, not the request's (a replica's
    process died under it): the API answers 503."""


@runtime_checkable
class Backend(Protocol):
    """A model server as the API sees it.

    - `info`, `tokenizer` (a transformers tokenizer: the API tokenizes, renders chat templates and
      checks lengths before anything is queued) and `table` (each token's text and bytes);
    - `stream`: the one way to run requests: an async iterator of lists of `Delta` (one list per step
      that released something, each choice's tokens with `k` alternatives), ending with a `StreamEnd`.
      With `k` None it releases no deltas and its `StreamEnd` carries every request's whole
      `GenerationOutput` (a request answered whole: `run_to_end`). Closing the iterator early, or
      cancelling the task that awaits it, aborts the requests (the backend drops them before their next
      step). Raises the request's error (RequestConflict), or BackendUnavailable;
    - `abort`: stop the requests with this id wherever they are;
    - `stats`: numbers for /health and /metrics: `in_flight`, `steps`, `kv_cache_bytes`, `failing`,
      `step_failures`, `request_failures` and, after a failure, `last_error` ({"type", "at"});
    - `generated`: the tokens generated so far by the running requests with this id (what a request
      abandoned mid-run is charged beside its prompt), or None where the backend cannot tell (replicas);
    - `steps_here`: whether the model's steps run in this process. Then `observe` gives the callbacks the
      backend calls after each step, `on_step(seconds, rows)`, and after each failure,
      `on_failure("step" | "request")`, on its own thread, and `collector` is None. A backend whose steps run
      elsewhere (Ray Serve replicas) ignores `observe` and brings its metrics as a Prometheus
      `collector`.
    """

    info: ModelInfo
    tokenizer: Any
    table: TokenTable
    steps_here: bool

    def stream(self, requests: list[GenerationRequest], k: int | None) -> AsyncIterator[list[Delta] | StreamEnd]: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict: ...

    def generated(self, request_id: str) -> int | None: ...

    def observe(self, on_step: Callable[[float, int], None] | None,
                on_failure: Callable[[str], None] | None) -> None: ...

    def collector(self) -> Any | None: ...


async def run_to_end(backend: Backend, requests: list[GenerationRequest]) -> list[GenerationOutput]:
    """Run requests to the end through the backend's one path, its stream without deltas, and return
    the outputs its `StreamEnd` carries. Cancelling the awaiting task aborts them (the stream is closed)."""
    events = backend.stream(requests, None)
    end = None
    try:
        async for event in events:
            if isinstance(event, StreamEnd):
                end = event
    finally:
        await events.aclose()
    if end is None or end.outputs is None:
        raise RuntimeError("the backend's stream ended without the requests' outputs")
    return end.outputs
