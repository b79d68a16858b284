"""The seam between the HTTP API and whatever runs the model.

The API hands over `GenerationRequest`s (a prompt's token ids, its sampling parameters, what to return)
and gets back, through the backend's one path (`Backend.stream`), `Delta`s then a `StreamEnd`, or,
answered whole, the `GenerationOutput`s that the `StreamEnd` carries (`run_to_end`). Everything here is plain
data (numpy arrays, strings, numbers): picklable, so it crosses a process boundary as it is (Ray Serve
replicas, cluster/ray_app.py), and free of torch, so `logprobe.api` and `logprobe.output` import without
it. `Backend` is what the API needs of a model server; the engine (engine/engine.py) implements it in
process, `cluster.ray_backend.RayBackend` through Ray Serve, and the API tests use a fake one.
"""

from .outputs import (
    ROW_COLUMNS,
    ChoiceOutput,
    Delta,
    FinishReason,
    GenerationOutput,
    PositionColumns,
    PromptColumns,
    StreamEnd,
    TokenTree,
    finished_without_forward,
)
from .protocol import Backend, BackendUnavailable, ModelInfo, RequestAborted, RequestConflict, run_to_end
from .requests import (
    BATCH,
    INTERACTIVE,
    PRIORITIES,
    Constraint,
    GenerationRequest,
    Intervention,
    SamplingParams,
    TreeShape,
)

__all__ = [
    "BATCH", "Backend", "BackendUnavailable", "ChoiceOutput", "Constraint", "Delta", "FinishReason",
    "GenerationOutput", "GenerationRequest", "INTERACTIVE", "Intervention", "ModelInfo", "PRIORITIES",
    "PositionColumns", "PromptColumns", "ROW_COLUMNS", "RequestAborted", "RequestConflict", "SamplingParams",
    "StreamEnd", "TokenTree", "TreeShape", "finished_without_forward", "run_to_end",
]
