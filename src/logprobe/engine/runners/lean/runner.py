"""`LeanRunner`: the device work of the lean runner (see the package's docstring): its forward pass over
the blocks, prompts prefilled in chunks, decode steps over the KV cache's size classes, and the
bookkeeping the engine's step loop calls."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Generator, Iterator

import numpy as np
import torch

from ..families import family_of
from ..interventions import Edits, segment_editor
from ..kv_cache import KVMemory
from ..prefix_cache import PrefixCache
from ..prompt_columns import CaptureDone, PromptColumnWriter, drain, logit_lens
from ...host.kv_manager import KVManager, Op, Row
from ...host.request import PromptColumns, SequenceGroup
from ...device.sampler import BatchSettings, to_device
from .attention import Attention, PassMeta, SlabRows
from .fixed_shape import FixedShapeSteps
from .prefill import PrefillState, begin_chunks, finish_chunks, prefill_chunks, prepare_prefill
from .prompt_batch import PromptBatches
from .tree import tree_pass
from .weights import Linear, load_blocks, packing_works, release_packed

log = logging.getLogger("logprobe.engine")


@dataclass
class GroupRecord:
    """What the runner keeps of one group (a request's prompt and its choices, or a token tree) while it
    runs: its prompt's state while prefilled; a tree's keys and values. Its rows of the KV cache are the
    engine's KV cache manager's (host/kv_manager.py). The scheduler's groups carry none of it."""

    prefill: PrefillState | None = None
    tree: object = None  # lean/tree.py's TreeKV
    cached: int = 0  # prompt tokens taken from the prefix cache instead of a pass
    columns: PromptColumns | None = None  # the prompt's columns, filled as its passes run, until handed over


class LeanRunner:
    """Runs a model a family claims (families/) with its own weights: the engine's step loop calls it as
    it calls `runner.ModelRunner`, with every running row of every request in one decode pass."""

    PREFILL_CHUNK = 512  # prompt tokens per engine step while other requests are decoding
    interleaves = True  # a prompt-only pass yields between its blocks: the engine's steps advance it (`prompt_pass`)
    RELEASE_PACKED = True  # see weights.release_packed; tests turn it off to compare with an engine that keeps both

    def __init__(self, model, int4_grids: dict | None = None, max_len: int | None = None, kv_positions: int = 256,
                 static_decode: bool | None = None, prefix_cache: PrefixCache | None = None,
                 kv: KVManager | None = None):
        """`prefix_cache`: the engine's (engine.py makes it; the scheduler finds prompts' hits in it);
        None: one of its own, of 256 MB (a runner built without an engine: tests, benchmarks). `kv`: the
        engine's KV cache manager, whose layout the decode steps read and whose operations this runner's
        memory carries out (None: one of its own, first class `kv_positions`, for a runner without an
        engine)."""
        family, reason = family_of(model)
        if family is None:
            raise ValueError(f"the lean runner cannot run this model: {reason}")
        self.family = family
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.layers = getattr(model, model.base_model_prefix).layers
        lm_head = model.get_output_embeddings()
        self.vocab_size = int(lm_head.weight.shape[0])  # read before the module may be emptied
        self.hidden_size = int(lm_head.weight.shape[1])
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self.num_heads, self.kv_heads, self.head_dim = family.num_heads, family.kv_heads, family.head_dim
        max_len = max_len or int(getattr(model.config, "max_position_embeddings", 4096))
        self.packed = packing_works(self.dtype, self.device)
        self.int4 = int4_grids is not None
        release = (lambda linears, root: release_packed(model, linears, root)) \
            if self.packed and self.RELEASE_PACKED else None
        self.blocks, windows, released = load_blocks(family, self.layers, int4_grids, self.packed, release)
        # per layer: None or its sliding window (one as long as the context masks nothing: a full layer)
        self.windows = [w if w is not None and w < max_len else None for w in windows]
        self.attention = Attention(self.windows, family.attention_scale(), self.num_heads, self.kv_heads,
                                   self.dtype, self.device, head_dim=self.head_dim)
        if self.device.type == "cpu" and not Attention.invariant_kernels():
            log.warning("torch %s: a request's numbers may differ in the last bits with what runs beside it "
                        "(batch invariance needs torch >= %s on a CPU: docs/performance.md)", torch.__version__,
                        ".".join(map(str, Attention.INVARIANT_TORCH)))
        self.final_norm = family.final_norm()
        self.head = Linear.of(lm_head, self.packed)  # (Linear: padding a call of 1 row)
        if release is not None:
            released += release((self.head,), model)
            log.info("lean runner: %.0f MB of transformers' weights released (kept once, packed for oneDNN)",
                     released / 2**20)
        self.columns = PromptColumnWriter(self.logprobs_of, self.vocab_size)
        self.kv_positions = kv_positions
        # Decode steps of fixed shapes (fixed_shape.py), replayed as CUDA graphs on a GPU; on a CPU (tests)
        # run eagerly. `pick_in_step`: whether such a step also picks the tokens (sampler.pick) in its
        # recorded pass, where no row filters; off, the engine picks after it (benchmarks/gpu_check.py
        # measures both).
        self.static_decode = self.device.type == "cuda" if static_decode is None else static_decode
        self.pick_in_step = True
        self.fixed_shape = FixedShapeSteps(self)
        # Keys and values of sequences already run, kept across requests of every kind (prefix_cache.py);
        # bounded by bytes, kept when idle, 0 turns it off.
        self.prefix_cache = PrefixCache(256 * 2**20) if prefix_cache is None else prefix_cache
        # The batched KV cache: where rows go is the engine's manager's (host/kv_manager.py), the memory
        # this runner's (kv_cache.py), made to match it
        self.kv = KVManager(max_len, capacity=kv_positions, prefix_index=self.prefix_cache,
                            keep_generated=not self.int4) if kv is None else kv
        self.cache = KVMemory(len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.device,
                              positions=self._slab_positions)
        self.cache.reset(self.kv)
        self.records: dict[object, GroupRecord] = {}  # per group that holds state here
        self.prompt_batches = PromptBatches(self)

    # ---- one pass of the blocks ------------------------------------------------------------
    def forward(self, ids: torch.Tensor, meta: PassMeta, capture=None, edit=None) -> torch.Tensor:
        """Embed ids [B, T] at meta.positions [B, T], run every block (attention as `meta` describes it),
        and return the final-norm hidden states [B, T, D]. `capture(layer, x)`, when given, sees the
        residual stream entering block 0 (layer 0) and leaving each block (layer i + 1); `edit(layer, x,
        positions)`, when given, returns the stream at those points as a request's interventions change
        it (interventions.py), before `capture` sees it and the next block reads it. (A plain loop, as
        the fixed-shape steps compile it: `forward_steps` is the same pass with pause points.)"""
        x, ropes = self._embed(ids, meta, capture, edit)
        for layer, block in enumerate(self.blocks):
            x = self._block(layer, block, x, ids.shape, ropes, meta, capture, edit)
        return self.final_norm(x).view(*ids.shape, -1)

    def forward_steps(self, ids: torch.Tensor, meta: PassMeta, capture=None, edit=None
                      ) -> Generator[int, None, torch.Tensor]:
        """`forward` as steps: yields after each block the positions it ran (B * T), and returns the
        final-norm hidden states. A prompt-only pass is advanced by the engine's steps that way
        (`prompt_pass`)."""
        x, ropes = self._embed(ids, meta, capture, edit)
        for layer, block in enumerate(self.blocks):
            x = self._block(layer, block, x, ids.shape, ropes, meta, capture, edit)
            yield ids.numel()
        return self.final_norm(x).view(*ids.shape, -1)

    def _embed(self, ids: torch.Tensor, meta: PassMeta, capture, edit) -> tuple[torch.Tensor, dict]:
        """The residual stream entering block 0, [B * T, D] (the products' own layout), and the RoPE tables."""
        x = self.family.embed(ids)
        if edit is not None:
            x = edit(0, x, meta.positions)
        if capture is not None:
            capture(0, x)
        return x.reshape(ids.numel(), -1), self._rope(x, meta.positions)

    def _block(self, layer: int, block, x: torch.Tensor, shape: torch.Size, ropes: dict, meta: PassMeta, capture,
               edit) -> torch.Tensor:
        """One block over the stream x [B * T, D]. Queries and keys are (normalized, where the family
        does, and) rotated together, in the projection's own layout, before the heads are transposed."""
        b, t = shape
        heads, kv_heads, d = self.num_heads, self.kv_heads, self.head_dim
        q_size, qk_size = heads * d, (heads + kv_heads) * d
        int4_rows = meta.int4_rows
        qkv = block.qkv(block.input_norm(x), int4_rows)
        qk = qkv[:, :qk_size].view(b, t, heads + kv_heads, d)
        if block.qk_norm is not None:
            qk = block.qk_norm(qk)
        cos, sin = ropes[block.rope]
        qk = qk * cos + qk.roll(d // 2, dims=-1) * sin
        q = qk[:, :, :heads].transpose(1, 2)  # [B, H, T, d]
        k = qk[:, :, heads:].transpose(1, 2)  # [B, KV, T, d]
        v = qkv[:, qk_size:].view(b, t, kv_heads, d).transpose(1, 2)
        out = block.o_proj(self.attention(layer, q, k, v, meta).transpose(1, 2).reshape(b * t, q_size), int4_rows)
        x = x + (out if block.post_attn_norm is None else block.post_attn_norm(out))
        gate, up = block.gate_up(block.pre_ff_norm(x), int4_rows).chunk(2, dim=-1)
        out = block.down_proj(block.act(gate) * up, int4_rows)
        x = x + (out if block.post_ff_norm is None else block.post_ff_norm(out))
        if edit is not None:
            x = edit(layer + 1, x.view(b, t, -1), meta.positions).reshape(b * t, -1)
        if capture is not None:
            capture(layer + 1, x.view(b, t, -1))
        return x

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> dict:
        """For each RoPE table of the family: cos and sin [B, T, 1, d] for `positions` [B, T], the
        sine's first half negated: with them a rotation is `x * cos + x.roll(d / 2) * sin`, the same
        arithmetic as transformers' rotate_half (a negation is exact) in four operations instead of seven."""
        half = self.head_dim // 2
        tables = {}
        for key, (cos, sin) in self.family.rope_tables(x, positions).items():
            sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
            tables[key] = cos[:, :, None], sin[:, :, None]
        return tables

    def _slab_positions(self, capacity: int) -> int:
        """The positions a KV cache class of `capacity` holds: on a CPU at least a read that gives a row
        the bits of every longer read (`Attention.held`), so a decode read cut at the class's end is one
        (a class of 256 where the kernel's short block is 192, or a context length of 300, would give a
        row other bits than the same row read further); elsewhere the capacity."""
        return self.attention.held(capacity) if self.device.type == "cpu" else capacity

    def logprobs_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """Raw next-token log probabilities, float32, for final-norm hidden states [..., D]."""
        logits = self.head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return torch.log_softmax(logits, dim=-1)

    def apply_final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.final_norm(hidden)

    def head_dtype(self) -> torch.dtype:
        return self.dtype

    PASS_HEAD_POSITIONS = 64  # positions a head run of a prompt-only pass takes: a run is as short as a block

    @property
    def prefill_chunk_tokens(self) -> int:
        return self.PREFILL_CHUNK

    # ---- activations ---------------------------------------------------------------------------
    @torch.inference_mode()
    def residual_stream(self, ids: list[int], layers: list[int], edits: Edits | None = None) -> dict[int, np.ndarray]:
        """{layer: [len(ids), D] float32} from one pass of the blocks over `ids` without a cache (the same
        layers as transformers' hooks give: layer 0 enters block 0, layer l leaves block l, before the
        final norm), under a request's `edits` where it has them; the pass stops after the deepest asked
        layer. Read here because in bfloat16 transformers' own copies of the weights are released."""
        wanted, deepest, store = set(layers), max(layers), {}

        def capture(layer, x):
            if layer in wanted:
                store[layer] = x[0].float().cpu()
            if layer == deepest:
                raise CaptureDone

        t = len(ids)
        masks, read = self.attention.own_pass(t)
        meta = PassMeta(torch.arange(t, device=self.device)[None], masks, read=read)
        try:
            self.forward(torch.tensor([ids], dtype=torch.long, device=self.device), meta, capture=capture,
                         edit=segment_editor([(0, 0, t, edits)]))
        except CaptureDone:
            pass
        return {layer: store[layer].numpy() for layer in store}

    @torch.inference_mode()
    def logit_lens(self, ids: list[int], layers: list[int], k: int, edits: Edits | None = None
                   ) -> dict[int, PromptColumns]:
        """{layer: columns of `ids`} from each asked layer's residual stream (prompt_columns.logit_lens)."""
        return logit_lens(self, ids, layers, k, edits)

    # ---- prompts -------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill_batch(self, groups: list[SequenceGroup]) -> None:
        """`prompt_pass` run through, for a caller without the engine (tests, benchmarks): not the
        runner contract's, which the engine's steps use."""
        drain(self.prompt_pass(groups))

    def prompt_pass(self, groups: list[SequenceGroup], hits: list | None = None) -> Iterator[int]:
        """Prompt-only groups (scoring, echo with max_tokens 0) in one pass, prefixes shared where they
        can be (prompt_batch.py), no KV cache kept for decoding, as steps: it yields after each block
        (the positions the block ran) and before each run of the head (0, over PASS_HEAD_POSITIONS
        positions at most), where the engine may end its step and go on in a later one (core.py). The
        pass keeps its activations meanwhile and touches no shared state the steps between change.
        `hits`: what the engine found of each prompt in the prefix cache (None: found here, for a
        caller without the engine)."""
        return self.prompt_batches.steps(groups, hits, self.PASS_HEAD_POSITIONS)

    def prefill_chunk(self, group: SequenceGroup, budget: int) -> torch.Tensor | None:
        """`prefill_chunks` for one group."""
        return self.prefill_chunks([(group, budget)])[0]

    @torch.inference_mode()
    def prefill_chunks(self, chunks: list[tuple[SequenceGroup, int]]) -> list[torch.Tensor | None]:
        """The next chunk of each (group, budget)'s prompt, in one forward pass (prefill.py). Per group,
        the log probabilities of its first token to generate ([1, V]) where its prompt is done, else None."""
        return prefill_chunks(self, chunks)

    def start_prompt(self, group: SequenceGroup, hit=None, held: int | None = None) -> None:
        """The prompt's prefill state, made now (lean/prefill.py): it starts after the `held` tokens of the
        prefix-cache hit the scheduler found (without them, a caller without the scheduler: after what
        the prefix cache holds, found here), whose store it holds from here on."""
        if self.prefill_state(group) is None:
            self.start_prefill(group, PrefillState(self, group, None if held is None else (hit, held)))

    def record(self, group) -> GroupRecord:
        """The group's record here, made at its first use."""
        record = self.records.get(group)
        if record is None:
            record = self.records[group] = GroupRecord()
        return record

    def prefill_state(self, group: SequenceGroup) -> PrefillState | None:
        record = self.records.get(group)
        return None if record is None else record.prefill

    def start_prefill(self, group: SequenceGroup, state: PrefillState) -> PrefillState:
        record = self.record(group)
        record.prefill, record.cached = state, state.done  # it starts after what the prefix cache held
        return state

    def prompt_columns(self, group: SequenceGroup) -> PromptColumns | None:
        record = self.records.get(group)
        if record is None:
            return None
        columns, record.columns = record.columns, None
        return columns

    def cached_tokens(self, group: SequenceGroup) -> int:
        record = self.records.get(group)
        return 0 if record is None else record.cached

    def rows_of(self, group: SequenceGroup) -> list[Row]:
        return self.kv.rows_of(group)

    @torch.inference_mode()
    def expand(self, group: SequenceGroup, rows: list[Row], ops: list[Op]) -> None:
        """The prompt is done: the room the manager made (`ops`), then each choice's slot (`rows`) filled
        with the prompt's keys and values."""
        self.move(ops)
        record = self.record(group)
        state, num = record.prefill, group.num_prompt_tokens
        keys, values = [k[:, :num] for k in state.keys], [v[:, :num] for v in state.values]
        for row in rows:
            self.cache.write(row.slab, row.slot, keys, values)
        record.prefill = None
        state.release(self.prefix_cache)

    @torch.inference_mode()
    def move(self, ops: list[Op]) -> None:
        """Carry out the KV cache manager's operations (a row's keys kept in the prefix cache, rows moved,
        classes grown or let go), in order."""
        if ops:
            self.cache.apply(ops, self._keep)

    def _keep(self, ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """A finished first choice's keys and values into the prefix cache (the manager's `Keep`)."""
        self.prefix_cache.insert(ids, keys, values, None)

    @torch.inference_mode()
    def tree_pass(self, tree, hit=None) -> torch.Tensor:
        """A token tree's next level, the prompt first (lean/tree.py): [rows, V] raw log probabilities."""
        return tree_pass(self, tree, hit)

    # ---- decode ------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode_groups(self, groups: list[SequenceGroup]) -> list[torch.Tensor]:
        """One decode step of every row, in one forward pass: the rows in the cache's order (size class by
        size class, slot order within each); attention once per class over its own view. Per group, its
        rows' log probabilities [rows, V] in the order of `group.rows`."""
        return self._decode(groups, None)[0]

    @torch.inference_mode()
    def decode_and_pick(self, groups: list[SequenceGroup], k: int) -> tuple[list[torch.Tensor], np.ndarray | None]:
        """`decode_groups`; where the step runs in fixed shapes (a CUDA graph on a GPU) and no row filters
        with top-k or top-p, the rows' tokens, their log probabilities and the k likeliest are picked in
        the same recorded pass (sampler.pick), their settings moved with the step's inputs in one copy:
        that array on the host, rows in the groups' order."""
        return self._decode(groups, k)

    def _decode_batch(self, held: list[list[Row]]) -> tuple[list, list[Row], np.ndarray]:
        """A decode step's batch, every row with room for one more position (the manager's `make_room`,
        which the engine's step carried out before): (the classes holding rows, as their memory with their
        rows, the rows class by class in slot order, each row's [last token, position])."""
        kv = self.kv
        if kv.num_rows != sum(len(r) for r in held):
            raise RuntimeError("the KV cache is out of step with the running groups")
        slabs = [self.cache.slab(kv, capacity) for capacity, c in kv.classes.items() if c.rows]
        rows = [r for slab in slabs for r in slab.rows]
        table = np.array([(r.group.sequences[r.seq_index].token_ids[-1], r.length) for r in rows], dtype=np.int64)
        return slabs, rows, table

    @staticmethod
    def _orders(slabs, held: list[list[Row]]) -> list[list[int]]:
        """Per group, its rows' places in the batch `_decode_batch` made, in the order of its rows."""
        offsets = {slab.capacity: start for slab, start in zip(slabs, np.cumsum([0] + [len(s.rows) for s in slabs]))}
        return [[int(offsets[row.slab]) + row.slot for row in mine] for mine in held]

    def _decode(self, groups: list[SequenceGroup], k: int | None) -> tuple[list[torch.Tensor], np.ndarray | None]:
        held = [self.rows_of(g) for g in groups]
        slabs, rows, table = self._decode_batch(held)
        edited = any(g.edits is not None for g in groups)  # a request's interventions: the eager pass
        static = self.static_decode and len(slabs) == 1 and not edited
        picking = None  # (k, whether any row is drawn) when the step picks the tokens itself
        if static and k is not None and self.pick_in_step:
            params = [r.group.params for r in rows]
            if not any(not p.is_greedy and (0 < p.top_k < self.vocab_size or p.top_p < 1.0) for p in params):
                sampled = not all(p.is_greedy for p in params)
                seeds = [r.group.sequences[r.seq_index].next_seed() for r in rows] if sampled else None
                table = np.concatenate([table, BatchSettings.table(params, self.vocab_size, seeds)], axis=1)
                picking = (k, sampled)
        inputs = to_device(table, torch.int64, self.device)  # one copy, queued behind the work already launched
        logprobs = picked = None
        if static:
            logprobs, picked = self.fixed_shape.run(self.cache.slabs[slabs[0].capacity], inputs, picking,
                                                    max(r.length for r in rows) + 1)
        if logprobs is None:
            logprobs = self._decode_eager(slabs, rows, inputs[:, :2])
        orders = self._orders(slabs, held)
        host = None
        if picked is not None:
            host = picked.cpu().numpy()  # the step's one transfer
            host = host[[i for order in orders for i in order]]
        return self._by_group(orders, logprobs), host

    @torch.inference_mode()
    def decode_with_prefill(self, groups: list[SequenceGroup], chunks: list[tuple[SequenceGroup, int]]
                            ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]] | None:
        """A decode step of every row and the next chunk of each prompt of `chunks`, in one pass of the
        blocks and one of the head (one read of every weight instead of two): the decode rows and the
        chunks packed in one row, each decode row attending over its slab as in a decode step, each chunk
        over its own prompt. (`decode_groups`' rows per group, `prefill_chunks`' answers per chunk); None
        where the two run apart: fixed-shape decode steps (CUDA graphs). With 4-bit weights the decode
        rows read those and the chunks the dense ones (`PassMeta.int4_rows`)."""
        if self.static_decode:
            return None
        held = [self.rows_of(g) for g in groups]
        slabs, rows, table = self._decode_batch(held)
        inputs = to_device(table, torch.int64, self.device)
        decode = self.prepare_decode(slabs, inputs[:, 1])
        parts, chunk_ids, segments = begin_chunks(self, chunks)
        prompt = prepare_prefill(self, parts)
        n = len(rows)
        meta = PassMeta(torch.cat([inputs[:, 1], prompt.positions[0]])[None], prompt.masks, kv=prompt.kv,
                        slabs=decode.slabs, split=n, int4_rows=decode.int4_rows)
        edit = segment_editor([(0, i, i + 1, r.group.edits) for i, r in enumerate(rows)] +
                              [(0, n + start, n + stop, edits) for _, start, stop, edits in segments])
        hidden = self.forward(torch.cat([inputs[:, 0], chunk_ids[0]])[None], meta, edit=edit)[0]
        out, finished = finish_chunks(self, chunks, parts, hidden[n:])
        logprobs = self.logprobs_of(torch.cat([hidden[:n], *finished]) if finished else hidden[:n])
        out = [None if o is None else logprobs[n + o:n + o + 1] for o in out]
        return self._by_group(self._orders(slabs, held), logprobs[:n]), out

    def _decode_eager(self, slabs, rows, inputs: torch.Tensor) -> torch.Tensor:
        """The decode pass over each slab's view of the positions held so far (inputs: [rows, 2] token and
        position): [rows, V] log probabilities."""
        meta = self.prepare_decode(slabs, inputs[:, 1])
        edit = segment_editor([(i, 0, 1, r.group.edits) for i, r in enumerate(rows)])
        return self.logprobs_of(self.forward(inputs[:, :1], meta, edit=edit)[:, -1])

    def prepare_decode(self, slabs, positions: torch.Tensor) -> PassMeta:
        """A decode step of every row of `slabs` (at `positions` [rows], slab by slab): each slab's rows read
        its first positions, as many as `Attention.aligned` gives for the longest row's, each row's own
        masked (so a row's bits do not depend on the rows beside it). Where every row is at the same
        position, their keys and values are written with one copy and share one mask (none where the
        span ends at that position and no layer has a sliding window)."""
        count, start, parts = positions.shape[0], 0, []
        for slab in slabs:
            n = len(slab.rows)
            longest = max(r.length for r in slab.rows) + 1
            read = min(slab.keys[0].shape[2], self.attention.aligned(longest))
            rows = None if n == count else slice(start, start + n)
            if all(r.length == longest - 1 for r in slab.rows):  # one copy, one mask
                parts.append(SlabRows(slab.keys, slab.values, rows, n, None, None, read,
                                      self.attention.step_views(longest - 1, read), longest - 1))
            else:
                mine = positions if n == count else positions[start:start + n]
                parts.append(SlabRows(slab.keys, slab.values, rows, n, mine, torch.arange(n, device=self.device), read,
                                      self.attention.decode_views(mine, read)))
            start += n
        return PassMeta(positions[:, None], slabs=parts, int4_rows=count if self.int4 else 0)

    def _by_group(self, orders: list[list[int]], logprobs: torch.Tensor) -> list[torch.Tensor]:
        """Each group's rows of the batch's log probabilities (`orders`: per group, its rows' places in
        the batch, in the order of its rows): slices where a group's rows are consecutive in the batch
        (the usual case), else one gather for all groups with an index moved in one copy (a list index
        would copy to the device once per group)."""
        if all(order == list(range(order[0], order[0] + len(order))) for order in orders if order):
            return [logprobs[order[0]:order[0] + len(order)] if order else logprobs[:0] for order in orders]
        gathered = logprobs.index_select(0, to_device([i for order in orders for i in order], torch.int64, self.device))
        return list(torch.split(gathered, [len(order) for order in orders]))

    # ---- bookkeeping -------------------------------------------------------------------------
    @torch.inference_mode()
    def select(self, group: SequenceGroup, keep: list[int], ops: list[Op]) -> None:
        """The group keeps its rows at the places `keep`: the manager's operations that free the others'
        slots (a finished first choice's keys and values kept in the prefix cache first)."""
        self.move(ops)

    @torch.inference_mode()
    def release(self, group, ops: list[Op] = ()) -> None:
        """The group is done (finished, aborted or failed): the manager's operations that free its rows'
        slots (a finished or aborted group's first choice kept in the prefix cache first), and its record
        dropped."""
        self.move(list(ops))
        record = self.records.pop(group, None)
        if record is not None and record.prefill is not None:
            record.prefill.release(self.prefix_cache)

    def reset(self) -> None:
        """Forget every record and start from new KV memory matching the manager's classes (after a failed
        step: the engine has failed every group that held a row, and reset its manager); the prefix cache
        is emptied too."""
        self.fixed_shape.graphs.clear()
        self.prefix_cache.clear()  # nothing kept from a step that failed
        # the engine failed (and released) every group of the step and every one holding KV rows; a
        # prompt-only pass the step did not advance (paused for it) keeps its record (its hit, its columns)
        self.records = {g: r for g, r in self.records.items() if not (r.prefill or r.tree)}
        self.cache.reset(self.kv)

    def is_consistent(self, running: list[SequenceGroup]) -> bool:
        """Whether the KV memory holds exactly the manager's classes (whose bookkeeping the engine
        checks: `KVManager.is_consistent`) and no operation failed part-way."""
        return self.cache.matches(self.kv)

    def on_idle(self) -> None:
        """The engine is idle (and has carried out its manager's `shrink`): let the fixed-shape steps go."""
        self.fixed_shape.graphs.clear()

    @property
    def kv_cache_bytes(self) -> int:
        return self.cache.nbytes

    @property
    def prefix_cache_bytes(self) -> int:
        return self.prefix_cache.nbytes

    def cache_stats(self) -> dict:
        cache = self.prefix_cache
        return {"kv_cache_bytes": self.cache.nbytes, "prefix_cache_bytes": cache.nbytes, "prefix_cache_hits": cache.hits,
                "prefix_cache_misses": cache.misses, "prefix_cache_tokens_saved": cache.tokens_saved}
