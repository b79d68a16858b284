"""The lean runner's decode step in fixed shapes, for a batch held in one size class (slab) of the KV
cache: the batch padded to a power of two, attention with a length mask over the least quarter of the
slab's capacity that holds the longest row, the tokens picked in the same pass. On a GPU each shape is
recorded once as a CUDA graph and replayed: the host launches one graph instead of ~30 kernels per block.
"""

from __future__ import annotations

import torch

from ...host.request import SamplingParams
from ...device.sampler import SETTINGS_COLUMNS, BatchSettings, pick, splitmix64
from .attention import PassMeta, SlabRows

# The lowest torch that `compile_step` is tested on: torch 2.6 cannot trace the pass (its CPU
# attention's decomposition reads a scalar), and 2.11 crashed compiling a second model's pass in one
# process; 2.12 and later pass tests/model/test_static_decode.py (tests/version_ranges.py runs both ends).
COMPILE_MIN_TORCH = (2, 12)


class FixedShapeSteps:
    """A runner's fixed-shape decode steps, kept by (padded batch, slab, span, picking)."""

    BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    MAX_KEPT = 8  # steps kept (on a GPU each holds its own working memory on the device)
    SPANS = 4  # a step attends over the first 1/4, 2/4, 3/4 or all of its slab's capacity

    def __init__(self, runner):
        self.runner = runner
        self.graphs: dict[tuple, StaticStep] = {}
        # A torch.compile backend for the step, or None (as it is). "inductor" fuses each block's small
        # kernels (norms, RoPE, cache writes, residual adds, the activation) between the products; off
        # until a GPU run shows it pays (benchmarks/gpu_check.py measures it both ways). (Not with a
        # CPU's pre-packed bfloat16 weights: Inductor does not lower oneDNN's packed product.)
        self._compile_step: str | None = None
        self._compiled: dict[str, object] = {}

    @property
    def compile_step(self) -> str | None:
        return self._compile_step

    @compile_step.setter
    def compile_step(self, backend: str | None) -> None:
        if backend is not None and torch.__version__ < COMPILE_MIN_TORCH:
            raise RuntimeError(f"compile_step needs torch >= {'.'.join(map(str, COMPILE_MIN_TORCH))}, the "
                               f"lowest version its tests pass on; this is torch {torch.__version__}")
        self._compile_step = backend

    def run(self, slab, inputs: torch.Tensor, picking: tuple[int, bool] | None, longest: int
            ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The decode step of the batch `inputs` (token, position, then with `picking` = (k, whether any
        row is drawn) the rows' sampling settings) held in `slab`: padded to the next size in
        BATCH_SIZES (padding rows write into the slab's unused slots, at position 0), attending over the
        first quarter, half, three quarters or all of the slab's capacity, the least that holds the
        batch's `longest` row after this step's position (past the first class a row's class is at most
        twice its length, so a span reads less than 1.5 times what the longest row holds, where the
        whole capacity read up to twice). So one step (a CUDA graph) replays until the slab changes or
        the longest row crosses into the next span. On a CPU the same pass runs eagerly, over the tensors
        its step was made on, as a replayed graph does (so the tests see a step kept past a change of its
        slab). (log probabilities [rows, V], the pick [rows, 2 + 2k] or None); (None, None) where the slab
        has too few slots for the padding."""
        count = inputs.shape[0]
        batch = next((b for b in self.BATCH_SIZES if b >= count), None)
        if batch is None or batch > slab.num_slots:
            return None, None
        for key in [k for k, step in self.graphs.items() if not step.holds(self.runner.cache)]:
            del self.graphs[key]  # its slab was replaced or dropped: its tensors go with it
        quarter = max(1, slab.capacity // self.SPANS)
        span = min(slab.capacity, -(-longest // quarter) * quarter)
        key = (batch, id(slab), span, picking)
        step = self.graphs.get(key)
        if step is None:
            step = StaticStep(self, slab, batch, picking, span)
            while len(self.graphs) >= self.MAX_KEPT:
                del self.graphs[next(iter(self.graphs))]
            self.graphs[key] = step
        step.load(inputs)
        logprobs, picked = step.run()
        return logprobs[:count], None if picked is None else picked[:count]

    def step_pass(self):
        """`decode_pass`, or its torch.compile'd form where `compile_step` names a backend: the whole
        pass traced as one graph (a graph break fails loudly), compiled at its first call (which a GPU
        makes before recording the CUDA graph) and again for new shapes (dynamic after the second)."""
        backend = self.compile_step
        if backend is None:
            return self.decode_pass
        if backend not in self._compiled:
            # the sampler's cached per-token constants, made here: a trace must not create them
            splitmix64(torch.zeros(1, dtype=torch.int64, device=self.runner.device), self.runner.vocab_size)
            self._compiled[backend] = torch.compile(self.decode_pass, backend=backend, fullgraph=True)
        return self._compiled[backend]

    def decode_pass(self, keys: list[torch.Tensor], values: list[torch.Tensor], ids: torch.Tensor,
                    positions: torch.Tensor, settings: torch.Tensor | None = None,
                    picking: tuple[int, bool] | None = None, span: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fixed-shape decode pass itself (what a CUDA graph records) over a slab's per-layer keys and
        values ([S, KV, capacity, d]), attending over their first `span` positions (None: all):
        [batch, V] log probabilities, and with `picking` = (k, sampled) the rows' pick from their
        `settings` (sampler.BatchSettings.table's columns) or None."""
        runner = self.runner
        batch, read = ids.shape[0], span or keys[0].shape[2]
        rows = SlabRows(keys, values, None, batch, positions, torch.arange(batch, device=runner.device), read,
                        runner.attention.decode_views(positions, read))
        meta = PassMeta(positions[:, None], slabs=[rows], int4_rows=batch if runner.int4 else 0)
        logprobs = runner.logprobs_of(runner.forward(ids, meta)[:, -1])
        if picking is None:
            return logprobs, None
        k, sampled = picking
        chosen = BatchSettings.on_device(settings, 0, False) if sampled else BatchSettings.all_greedy_rows()
        return logprobs, pick(logprobs, chosen, k)


class StaticStep:
    """One fixed-shape decode step: its input buffers, and on a GPU the CUDA graph that replays it. It
    keeps the slab's tensors it was recorded on (so their memory cannot be reused under it), and is
    dropped as soon as the slab holds other tensors."""

    def __init__(self, steps: FixedShapeSteps, slab, batch: int, picking: tuple[int, bool] | None = None,
                 span: int | None = None):
        self.steps, self.slab, self.batch, self.picking, self.span = steps, slab, batch, picking, span
        self.device = steps.runner.device
        self.tensors = (list(slab.keys), list(slab.values))
        # the step's inputs: token, position, then (when it picks) BatchSettings.table's columns; padding
        # rows take token 0 at position 0 and are greedy (temperature 1: nothing divides by 0)
        width = 2 if picking is None else 2 + SETTINGS_COLUMNS
        self.padding = torch.zeros(width, dtype=torch.int64)
        if picking is not None:
            self.padding[2:] = torch.from_numpy(BatchSettings.table([SamplingParams(temperature=0.0)], 1, None)[0])
        self.padding = self.padding.to(self.device)
        self.inputs = self.padding.repeat(batch, 1)
        self.graph = None
        self.out = None

    def holds(self, cache) -> bool:
        slab = cache.slabs.get(self.slab.capacity)
        return slab is self.slab and all(a is b for a, b in zip(self.tensors[0] + self.tensors[1],
                                                                  slab.keys + slab.values))

    def load(self, inputs: torch.Tensor) -> None:
        count = inputs.shape[0]
        self.inputs[:count] = inputs
        if count < self.batch:
            self.inputs[count:] = self.padding

    def _pass(self):
        inputs = self.inputs
        return self.steps.step_pass()(*self.tensors, inputs[:, :1], inputs[:, 1], inputs[:, 2:], self.picking,
                                      self.span)

    def run(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.device.type != "cuda":
            return self._pass()
        if self.graph is None:
            # Record after one pass on a side stream (kernels choose their algorithms there). Both write
            # the same keys and values at the same positions as the replay below.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._pass()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.out = self._pass()
            self.graph = graph
        self.graph.replay()
        return self.out
