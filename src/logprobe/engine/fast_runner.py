"""The lean path: logprobe runs a decoder's blocks itself, with the model's own weights and modules, over
a KV cache in size classes (kv_cache.py). What differs between model families (weight layout, norms, RoPE tables, sliding
windows, attention scale, activation) is described by a family file in families/ (Llama/Mistral/Qwen2,
Gemma 3, Qwen 3, Phi-3); a model no family claims, or a configuration its family refuses, runs on
transformers' forward (runner.py) instead.

* Decode: every running sequence of every request in one forward pass: one new token per row, keys
  and values written into the row's slot, attention over each size class's `[:rows, :, :longest]` with
  a length mask (and the layer's sliding window, where it has one). On a GPU, a batch held in one
  size class runs a fixed-shape step instead (padded to a power of two, attention with a length mask
  over the least quarter of the class's capacity that holds the longest row, the tokens picked in the
  same pass), recorded once as a CUDA graph per batch size, class and span and replayed
  (`_decode_static`): the host launches one graph instead of ~30 kernels per block.
* Prefill: in chunks (a long prompt takes several engine steps, so it does not stall the decoding of
  others), into a per-group buffer that moves into slots when the prompt is done.
* Prompt-only groups (scoring, echo): one right-padded pass, no KV cache kept; prompts of the batch
  that begin with the same tokens (a context and its continuations) run that prefix once.
* bfloat16: every projection and the head pre-packed for oneDNN once (same numbers as the plain
  product). `--quantization int4`: decode steps of up to INT4_MAX_ROWS rows use the model's own 4-bit
  weights (int4.py).

Numbers are the same computation as transformers' (same modules, same RoPE, same masks up to padding),
checked against a float64 forward of transformers' own implementation in the tests.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from .families import family_of
from .int4 import Int4Linear
from .interventions import Edits, segment_editor
from .kv_cache import Row, SlabCache
from .prefix_cache import BLOCK, PrefixCache
from .request import PromptColumns, SamplingParams, SequenceGroup
from .sampler import SETTINGS_COLUMNS, BatchSettings, _counters, pick, to_device
from .runner import ModelRunner, _Captured

log = logging.getLogger("logprobe.engine")
# The lowest torch that `compile_step` is tested on: torch 2.6 cannot trace the pass (its CPU
# attention's decomposition reads a scalar), and 2.11 crashed compiling a second model's pass in one
# process; 2.12 and later pass tests/model/test_static_decode.py (tests/version_ranges.py runs both ends).
COMPILE_MIN_TORCH = (2, 12)


def supports(model) -> bool:
    """Whether a family of the lean path runs this model; if not, why is logged (it then runs on
    transformers' forward)."""
    family, reason = family_of(model)
    if family is None:
        log.info("lean path unavailable, running on transformers' forward: %s", reason)
    return family is not None


def packing_works(dtype, device) -> bool:
    """Whether weights can be pre-packed for oneDNN here: bfloat16/float16 on a CPU with oneDNN, and a
    probe product equals the plain one bit for bit (so packing changes speed, never a number)."""
    if dtype not in (torch.bfloat16, torch.float16) or device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(96, 64, generator=gen).to(dtype)
        x = torch.randn(3, 5, 64, generator=gen).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        return torch.equal(torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), F.linear(x, w))
    except Exception:  # an op missing from this build of torch: the plain product
        return False


class Linear:
    """A weight [N, K] (and bias) of the lean path. In bfloat16 on CPUs the weight is pre-packed once
    into oneDNN's blocked layout: the plain bfloat16 product repacks it on every call, which costs
    more than the product itself for a few rows (one-row products 1.9x, an 84-row one 1.5x, the
    output head for one row 1.5x faster measured here). Same kernel, same numbers."""

    __slots__ = ("weight", "bias", "packed", "int4")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool, int4: Int4Linear | None = None):
        self.weight, self.bias = weight, bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight) if pack else None
        self.int4 = int4  # the same matrix as 4-bit integers, for decode steps of few rows

    @classmethod
    def of(cls, module, pack: bool, int4: Int4Linear | None = None) -> "Linear":
        return cls(module.weight, module.bias, pack, int4)

    def __call__(self, x: torch.Tensor, few_rows: bool = False) -> torch.Tensor:
        if few_rows and self.int4 is not None:
            y = self.int4(x)
            return y if self.bias is None else y + self.bias
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class PrefillState:
    """A group's prompt while it is being prefilled: keys/values so far and its prompt columns."""

    def __init__(self, runner: "FastRunner", group: SequenceGroup):
        n = group.num_prompt_tokens
        shape = (runner.kv_heads, n, runner.head_dim)
        self.keys = [torch.empty(shape, dtype=runner.dtype, device=runner.device) for _ in runner.layers]
        self.values = [torch.empty(shape, dtype=runner.dtype, device=runner.device) for _ in runner.layers]
        self.done = 0
        self.ids = torch.tensor(group.prompt_ids, dtype=torch.long, device=runner.device)


class FastRunner(ModelRunner):
    supports_batched_decode = True
    PREFILL_CHUNK = 512  # prompt tokens per engine step while other requests are decoding

    INT4_MAX_ROWS = 8  # decode steps of up to this many rows read the 4-bit weights (when loaded)

    def __init__(self, model, int4_grids: dict | None = None, max_len: int | None = None, kv_positions: int = 256,
                 static_decode: bool | None = None, prefix_cache_bytes: int = 256 * 2**20):
        super().__init__(model)
        family, reason = family_of(model)
        if family is None:
            raise ValueError(f"the lean path cannot run this model: {reason}")
        self.family = family
        cfg = self.config
        self.layers = self.decoder.layers
        self.num_heads, self.kv_heads, self.head_dim = family.num_heads, family.kv_heads, family.head_dim
        self.scale = family.attention_scale()
        self.dtype = next(model.parameters()).dtype
        max_len = max_len or int(getattr(cfg, "max_position_embeddings", 4096))
        pack = packing_works(self.dtype, self.device)
        self.int4 = int4_grids is not None
        with torch.no_grad():
            blocks = family.blocks()  # fuses q/k/v and gate/up where the model keeps them apart
        # per layer: None or its sliding window (one as long as the context masks nothing: a full layer)
        self.windows = [b.window if b.window is not None and b.window < max_len else None for b in blocks]
        self.window_sizes = sorted({w for w in self.windows if w is not None})
        release = pack and self.RELEASE_PACKED
        released = 0
        self.blocks = []
        for index in range(len(blocks)):
            block, blocks[index] = blocks[index], None  # its fused weights are held by its Linears only
            q4 = [None] * 4
            if int4_grids is not None:
                try:
                    q4 = [Int4Linear([int4_grids[f"layers.{index}.{name}"] for name in names])
                          for names in block.int4_names]
                except KeyError as exc:
                    raise ValueError(f"no 4-bit grid for {exc.args[0]}") from None
            linears = (Linear(*block.qkv, pack, q4[0]), Linear.of(block.o_proj, pack, q4[1]),
                       Linear(*block.gate_up, pack, q4[2]), Linear.of(block.down_proj, pack, q4[3]))
            self.blocks.append((*linears, block.input_norm, block.pre_ff_norm, block.act, block.post_attn_norm,
                                block.post_ff_norm, block.qk_norm, block.rope))
            del block
            if release:  # layer by layer: the peak is the weights and one layer's packed copy
                released += self._release(linears, self.layers[index])
        self.final_norm = family.final_norm()
        self.head = Linear.of(self.lm_head, pack)
        if release:
            released += self._release((self.head,), self.model)
            log.info("lean path: %.0f MB of transformers' weights released (kept once, packed for oneDNN)",
                     released / 2**20)
        self.packed = pack
        self.kv_positions = kv_positions
        self.cache = SlabCache(len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.device,
                               max_len=max_len, capacity=kv_positions)
        # Decode steps of fixed shapes (a batch padded to a power of two, attention over the slab's whole
        # capacity with a length mask), replayed as CUDA graphs on a GPU; on a CPU (tests) run eagerly.
        self.static_decode = self.device.type == "cuda" if static_decode is None else static_decode
        self.graphs: dict[tuple, StaticStep] = {}
        # whether a fixed-shape step also picks the tokens (sampler.pick) in its recorded pass, where no
        # row filters; off, the engine picks after it (benchmarks/gpu_check.py measures both)
        self.pick_in_step = True
        # A torch.compile backend for the fixed-shape step, or None (as it is). "inductor" fuses each
        # block's small kernels (norms, RoPE, cache writes, residual adds, the activation) between the
        # products; off until a GPU run shows it pays (benchmarks/gpu_check.py measures it both ways).
        # (Not with a CPU's pre-packed bfloat16 weights: Inductor does not lower oneDNN's packed product.)
        self._compile_step: str | None = None
        self._compiled: dict[str, object] = {}
        # Prompt prefixes' keys and values kept across batches of prompt-only groups (prefix_cache.py);
        # bounded by bytes, kept when idle, 0 turns it off.
        self.prefix_cache = PrefixCache(prefix_cache_bytes)

    RELEASE_PACKED = True  # see _release; tests turn it off to compare with an engine that keeps both

    def _release(self, linears, root) -> int:
        """Keep each packed weight once: the packed copy is all the lean path reads, so transformers'
        modules under `root` whose weights these Linears packed are emptied, and the Linears drop their
        plain weight too (bytes freed returned). In bfloat16 the weights would otherwise be held twice
        (an 8B model: 16 GB more). A head tied to the embedding is kept: the lean path embeds with it.
        transformers' forward of this model cannot run afterwards; nothing on the lean path calls it
        (activations are read by `residual_stream`)."""
        storages = {lin.weight.untyped_storage().data_ptr(): lin.weight.untyped_storage().nbytes()
                    for lin in linears}
        storages.pop(self.model.get_input_embeddings().weight.untyped_storage().data_ptr(), None)
        for module in root.modules():
            weight = getattr(module, "weight", None)
            if (isinstance(module, torch.nn.Linear) and isinstance(weight, torch.Tensor) and weight.numel()
                    and weight.untyped_storage().data_ptr() in storages):
                module.weight = torch.nn.Parameter(weight.new_empty(0), requires_grad=False)
        for lin in linears:
            if lin.weight.untyped_storage().data_ptr() in storages:
                lin.weight = None
        return sum(storages.values())

    # ---- one pass of the blocks ------------------------------------------------------------
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

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, attend, decode: bool = False,
             capture=None, edit=None) -> torch.Tensor:
        """Embed ids [B, T] at positions [B, T], run every block with `attend(layer, q, k, v)` doing the
        cache write and attention, and return the final-norm hidden states [B, T, D]. Queries and keys
        are (normalized, where the family does, and) rotated together, in the projection's own layout,
        before the heads are transposed. `capture(layer, x)`, when given, sees the residual stream
        entering block 0 (layer 0) and leaving each block (layer i + 1); `edit(layer, x, positions)`,
        when given, returns the stream at those points as a request's interventions change it
        (interventions.py), before `capture` sees it and the next block reads it."""
        x = self.family.embed(ids)
        if edit is not None:
            x = edit(0, x, positions)
        if capture is not None:
            capture(0, x)
        ropes = self._rope(x, positions)
        b, t = ids.shape
        x = x.reshape(b * t, -1)  # the blocks' activations are [B * T, D]: the products' own layout
        heads, kv_heads, d = self.num_heads, self.kv_heads, self.head_dim
        q_size, qk_size = heads * d, (heads + kv_heads) * d
        half = d // 2
        few = decode and self.int4 and b * t <= self.INT4_MAX_ROWS
        for layer, (qkv_proj, o_proj, gate_up_proj, down_proj, norm1, norm2, act, post_attn, post_ff, qk_norm,
                    rope) in enumerate(self.blocks):
            qkv = qkv_proj(norm1(x), few)
            qk = qkv[:, :qk_size].view(b, t, heads + kv_heads, d)
            if qk_norm is not None:
                qk = qk_norm(qk)
            cos, sin = ropes[rope]
            qk = qk * cos + qk.roll(half, dims=-1) * sin
            q = qk[:, :, :heads].transpose(1, 2)
            k = qk[:, :, heads:].transpose(1, 2)
            v = qkv[:, qk_size:].view(b, t, kv_heads, d).transpose(1, 2)
            out = o_proj(attend(layer, q, k, v).transpose(1, 2).reshape(b * t, q_size), few)  # attend: [B, H, T, d]
            x = x + (out if post_attn is None else post_attn(out))
            gate, up = gate_up_proj(norm2(x), few).chunk(2, dim=-1)
            out = down_proj(act(gate) * up, few)
            x = x + (out if post_ff is None else post_ff(out))
            if edit is not None:
                x = edit(layer + 1, x.view(b, t, -1), positions).reshape(b * t, -1)
            if capture is not None:
                capture(layer + 1, x.view(b, t, -1))
        return self.final_norm(x).view(b, t, -1)

    def _bands(self, causal: torch.Tensor, first: int) -> dict:
        """{window: mask} for a causal mask [Q, K] whose query i sits at position first + i over keys at
        positions 0..K-1: the causal mask with keys at or before p - window dropped. `None` maps to the
        causal mask itself (full-attention layers)."""
        masks = {None: causal}
        for window in self.window_sizes:
            masks[window] = causal.triu(first - window + 1)
        return masks

    def _additive(self, masks: dict) -> dict:
        """Boolean masks (True: seen) as the additive masks SDPA makes of them (0 where seen, -inf
        elsewhere, in the queries' dtype), made once per pass: given a boolean mask, SDPA converts it on
        every call, once per layer (a kernel per layer on a GPU, inside the recorded decode step too).
        The same numbers bit for bit. None stays None; a mask that several keys share is made once."""
        # (boolean, additive) pairs, found with `is` rather than id(), which torch.compile cannot trace
        made: list[tuple[torch.Tensor, torch.Tensor]] = []
        out = {}
        for key, mask in masks.items():
            if mask is not None:
                additive = None
                for seen, add in made:
                    if seen is mask:
                        additive = add
                if additive is None:
                    additive = torch.zeros(mask.shape, dtype=self.dtype, device=mask.device).masked_fill_(
                        ~mask, float("-inf"))
                    made.append((mask, additive))
                mask = additive
            out[key] = mask
        return out

    def logprobs_of(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return torch.log_softmax(logits, dim=-1)

    def apply_final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.final_norm(hidden)

    def head_dtype(self) -> torch.dtype:
        return self.dtype

    def _causal_attend(self, length: int):
        """`attend` for a pass over positions 0..length-1 without a cache: the causal mask (with each
        sliding window's band where the model has them)."""
        masks = {None: None}  # full attention: is_causal
        if self.window_sizes:
            causal = torch.ones(length, length, dtype=torch.bool, device=self.device).tril()
            masks = self._additive(self._bands(causal, 0))
            masks[None] = None
        windows = self.windows

        def attend(layer, q, k, v):
            mask = masks[windows[layer]]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                                                  enable_gqa=self.kv_heads != self.num_heads)

        return attend

    # ---- activations ---------------------------------------------------------------------------
    @torch.inference_mode()
    def residual_stream(self, ids: list[int], layers: list[int], edits: Edits | None = None) -> dict[int, np.ndarray]:
        """{layer: [len(ids), D] float32} from one pass of the lean blocks over `ids` without a cache
        (the same layers as transformers' hooks give: layer 0 enters block 0, layer l leaves block l,
        before the final norm), under a request's `edits` where it has them; the pass stops after the
        deepest asked layer. On the lean path because in bfloat16 transformers' own copies of the
        weights are released (`_release`)."""
        wanted, deepest, store = set(layers), max(layers), {}

        def capture(layer, x):
            if layer in wanted:
                store[layer] = x[0].float().cpu()
            if layer == deepest:
                raise _Captured

        t = len(ids)
        try:
            self._run(torch.tensor([ids], dtype=torch.long, device=self.device),
                      torch.arange(t, device=self.device)[None], self._causal_attend(t), capture=capture,
                      edit=segment_editor([(0, 0, t, edits)]))
        except _Captured:
            pass
        return {layer: store[layer].numpy() for layer in store}

    # ---- prefill -----------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill_chunk(self, group: SequenceGroup, budget: int) -> torch.Tensor | None:
        state = group.cache
        if state is None:
            state = group.cache = PrefillState(self, group)
            if group.params.needs_prompt_logits:
                group.prompt_columns = self.new_prompt_columns(group.num_prompt_tokens, group.params)
        start, total = state.done, group.num_prompt_tokens
        stop = min(total, start + max(1, budget))
        ids = state.ids[start:stop][None]
        positions = torch.arange(start, stop, device=self.device)[None]
        if start == 0 and not self.window_sizes:  # the whole prompt so far: plain causal attention, which
            masks = {None: None}  # lets SDPA take its flash kernels on a GPU (a mask does not)
        else:
            masks = self._additive(self._bands(torch.ones(stop - start, stop, dtype=torch.bool, device=self.device)
                                               .tril(start), start))
        windows = self.windows

        def attend(layer, q, k, v):
            state.keys[layer][:, start:stop] = k[0]
            state.values[layer][:, start:stop] = v[0]
            keys, values = state.keys[layer][None, :, :stop], state.values[layer][None, :, :stop]
            mask = masks[windows[layer]]
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                                  scale=self.scale, enable_gqa=self.kv_heads != self.num_heads)

        hidden = self._run(ids, positions, attend, edit=segment_editor([(0, 0, stop - start, group.edits)]))[0]  # [C, D]
        if group.prompt_columns is not None:
            self.fill_prompt_columns(group.prompt_columns, hidden, state.ids, start)
        state.done = stop
        if stop < total:
            return None
        return self.logprobs_of(hidden[-1:])

    @torch.inference_mode()
    def prefill_batch(self, groups: list[SequenceGroup]) -> None:
        """Prompt-only groups (scoring, echo with max_tokens 0) in one right-padded pass of the lean path
        (its packed weights in bfloat16); no KV cache is kept for decoding. The plain causal mask is
        enough: padding sits after each prompt, so a real position never sees it (padded positions'
        outputs are dropped).

        A prompt's first tokens can skip the blocks two ways (`_prefill_shared` then runs the batch):
        prompts of the batch that begin with the same tokens (one context, several continuations: a
        multiple-choice question) share that prefix's pass, and a prompt that begins with a prefix kept in
        the prefix cache from an earlier batch attends to its keys and values (lm-evaluation-harness
        sorts requests by length, so the answers of one question mostly come in different batches). A
        prompt uses the batch's shared prefix where it is longer than its kept one, else the kept one (a
        header every question begins with, kept, must not undo the sharing of a question's whole context
        within the batch). After the pass, each shared prefix and each prompt's own whole blocks go into
        the cache (`_seeds`)."""
        cache = self.prefix_cache
        # A group with interventions runs a modified forward pass: its keys and values are not those of
        # its tokens alone, so it neither uses nor seeds the prefix cache, nor shares a prefix in the batch.
        plain = [i for i, g in enumerate(groups) if not g.params.interventions]
        hits = {}
        for i in plain:
            hit = cache.lookup(groups[i].prompt_ids)
            if hit is not None:
                hits[i] = hit
        clusters, taken = [], set()
        for length, members in shared_prefixes([groups[i].prompt_ids for i in plain], self.SHARED_PREFIX_MIN):
            members = [i for i in (plain[j] for j in members) if i not in hits or hits[i][0] < length]
            if len(members) > 1:
                clusters.append((length, members))
                taken.update(members)
        kept: dict[tuple, tuple] = {}  # the other hits, by prefix: a cluster whose prefix's pass was run before
        for i, (length, keys, values, hidden) in hits.items():
            if i not in taken:
                key = (length, tuple(groups[i].prompt_ids[:length]))
                kept.setdefault(key, (length, [], (keys, values, hidden)))[1].append(i)
        clusters += kept.values()
        if clusters:
            return self._prefill_shared(groups, clusters)
        lengths = [g.num_prompt_tokens for g in groups]
        longest = max(lengths)
        ids = torch.zeros((len(groups), longest), dtype=torch.long)
        for row, g in enumerate(groups):
            ids[row, :lengths[row]] = torch.tensor(g.prompt_ids, dtype=torch.long)
        ids = ids.to(self.device)
        positions = torch.arange(longest, device=self.device)[None].expand(len(groups), -1)
        firsts = [0] * len(groups)
        seeds = self._seeds(groups, plain, firsts, {})
        causal = self._causal_attend(longest)

        def attend(layer, q, k, v):
            self._keep_seeds(seeds, layer, k, v, firsts, {})
            return causal(layer, q, k, v)

        edit = segment_editor([(row, 0, lengths[row], g.edits) for row, g in enumerate(groups)])
        hidden = self._run(ids, positions, attend if seeds else causal, edit=edit)
        for row, g in enumerate(groups):
            if g.params.needs_prompt_logits:
                n = lengths[row]
                g.prompt_columns = self._prompt_columns(hidden[row, :n], ids[row, :n], g.params)
        self._insert_seeds(groups, seeds, hidden, firsts, {})

    SHARED_PREFIX_MIN = 16  # prompt-only prompts sharing at least this many first tokens share their pass

    def _prefill_shared(self, groups: list[SequenceGroup], clusters: list[tuple]) -> None:
        """`clusters`: (length, members) for a prefix the members share within the batch, or (length,
        members, (keys, values, hidden)) for one kept in the prefix cache. Each shared prefix runs once
        (its keys, values and final hidden states kept); a kept one does not run at all. Then every
        prompt's own tokens run in one right-padded pass whose rows attend to their prefix's keys and
        values and to their own, at their true positions (a row without a prefix attends to its own
        only). Each group's columns come from its prefix's hidden states and its own, as from one pass
        (the prefix's rows through the head here, whether its blocks ran here or in an earlier batch)."""
        prefix_of = {}  # group index -> (prefix length, keys per layer, values per layer, hidden [P, D])
        ran = []  # the batch's shared prefixes, for the prefix cache: (ids, keys, values, hidden)
        copies = {}  # group index -> tokens of its prefix an entry of its own blocks would hold twice
        for length, members, *kept in clusters:
            if kept:
                keys, values, hidden = kept[0]
                copies.update((m, length) for m in members
                              if self.prefix_cache.branches(groups[m].prompt_ids, length))
            else:
                copies.update((m, length) for m in members)
                prefix = groups[members[0]].prompt_ids[:length]
                ids = torch.tensor([prefix], dtype=torch.long).to(self.device)
                keys, values = [None] * len(self.blocks), [None] * len(self.blocks)
                causal = self._causal_attend(length)

                def attend(layer, q, k, v, keys=keys, values=values, causal=causal):
                    keys[layer], values[layer] = k[0], v[0]  # [KV, P, d]
                    return causal(layer, q, k, v)

                hidden = self._run(ids, torch.arange(length, device=self.device)[None], attend)[0]
                ran.append((prefix, keys, values, hidden))
            for m in members:
                prefix_of[m] = (length, keys, values, hidden)
        firsts = [prefix_of[i][0] if i in prefix_of else 0 for i in range(len(groups))]
        own = [g.num_prompt_tokens - first for g, first in zip(groups, firsts)]
        rows, longest_own, longest_prefix = len(groups), max(own), max(firsts)
        ids = torch.zeros((rows, longest_own), dtype=torch.long)
        for row, g in enumerate(groups):
            ids[row, :own[row]] = torch.tensor(g.prompt_ids[firsts[row]:], dtype=torch.long)
        ids = ids.to(self.device)
        first = torch.tensor(firsts, device=self.device)[:, None]
        step = torch.arange(longest_own, device=self.device)[None]
        positions = first + step  # [rows, own]: each row's true positions
        # keys: [prefix slots 0..longest_prefix-1 | own slots]; a key's position, and whether it is real
        slot = torch.arange(longest_prefix, device=self.device)[None]
        key_pos = torch.cat([slot.expand(rows, -1), positions], dim=1)
        key_real = torch.cat([slot < first, step < torch.tensor(own, device=self.device)[:, None]], dim=1)
        seen = key_real[:, None, :] & (key_pos[:, None, :] <= positions[:, :, None])  # [rows, own, keys]
        masks = {None: seen[:, None]}
        for window in self.window_sizes:
            masks[window] = (seen & (positions[:, :, None] - key_pos[:, None, :] < window))[:, None]
        masks = self._additive(masks)
        windows = self.windows
        kv_shape = (rows, self.kv_heads, longest_prefix, self.head_dim)
        seeds = self._seeds(groups, [i for i, g in enumerate(groups) if not g.params.interventions], firsts, copies)

        def attend(layer, q, k, v):
            prefix_k = torch.zeros(kv_shape, dtype=k.dtype, device=k.device)
            prefix_v = torch.zeros(kv_shape, dtype=v.dtype, device=v.device)
            for row, (length, keys, values, _) in prefix_of.items():
                prefix_k[row, :, :length] = keys[layer]
                prefix_v[row, :, :length] = values[layer]
            self._keep_seeds(seeds, layer, k, v, firsts, prefix_of)
            return F.scaled_dot_product_attention(q, torch.cat([prefix_k, k], dim=2), torch.cat([prefix_v, v], dim=2),
                                                  attn_mask=masks[windows[layer]], scale=self.scale,
                                                  enable_gqa=self.kv_heads != self.num_heads)

        # rows with interventions have no prefix: their own tokens are the whole prompt, from position 0
        edit = segment_editor([(row, 0, own[row], g.edits) for row, g in enumerate(groups)])
        hidden = self._run(ids, positions, attend, edit=edit)
        done: list[tuple] = []  # (prefix hidden, params, columns with the prefix's rows filled)
        for row, g in enumerate(groups):
            if not g.params.needs_prompt_logits:
                continue
            full = torch.tensor(g.prompt_ids, dtype=torch.long, device=self.device)
            mine = hidden[row, :own[row]]
            if row not in prefix_of:
                g.prompt_columns = self._prompt_columns(mine, full, g.params)
                continue
            # Rows 1..P-1 (the prefix's own tokens) are the same for every prompt of the prefix: reduced
            # once per prefix and settings, copied; rows P.. (predicted from the prefix's last state on)
            # are this prompt's own.
            length, _, _, prefix_hidden = prefix_of[row]
            cols = self.new_prompt_columns(g.num_prompt_tokens, g.params)
            filled = next((c for h, p, c in done if h is prefix_hidden and p == g.params), None)
            if filled is None:
                self.fill_prompt_columns(cols, prefix_hidden[:length - 1], full, 0)
                done.append((prefix_hidden, g.params, cols))
            else:
                copy_rows(filled, cols, 1, length)
            self.fill_prompt_columns(cols, torch.cat([prefix_hidden[length - 1:], mine]), full, length - 1)
            g.prompt_columns = cols
        self._insert_seeds(groups, seeds, hidden, firsts, prefix_of)
        for prefix, keys, values, prefix_hidden in ran:  # after the prompts' own blocks: a shared prefix
            self.prefix_cache.insert(prefix, keys, values, prefix_hidden)  # one of them holds is not kept twice

    def _seeds(self, groups: list[SequenceGroup], plain: list[int], firsts: list[int],
               copies: dict[int, int]) -> list[tuple]:
        """The rows of a pass whose own whole blocks go into the prefix cache: (row, m, keys, values), the
        lists filled per layer during the pass by `_keep_seeds`. A row of `plain` (no interventions) is
        one whose first m tokens (m: its length cut to whole blocks) add a block at least to its prefix
        (`firsts[row]`: from the batch or the cache, 0 for none), and no fewer tokens than they would hold
        a second time (`copies[row]`: its prefix, where the batch shares it or a kept entry goes on past
        it), that no entry holds already and no earlier row of the batch seeds.

        Entries do not share memory, so a branch off a kept prefix holds the prefix again: with every
        answer seeding its own blocks, benchmarks/multiple_choice.py's answers in separate batches left
        57 entries of 4.4 MB for 24 questions (252 MB) instead of 24, and a question's later answers seldom
        reach a block past where they part. An entry that only extends a kept one replaces it."""
        cache, seeds, seen = self.prefix_cache, [], set()
        if not cache.enabled:
            return seeds
        for row in plain:
            ids = groups[row].prompt_ids
            m = len(ids) // BLOCK * BLOCK
            if (m - firsts[row] >= max(BLOCK, copies.get(row, 0)) and tuple(ids[:m]) not in seen
                    and not cache.covers(ids[:m])):
                seen.add(tuple(ids[:m]))
                seeds.append((row, m, [None] * len(self.blocks), [None] * len(self.blocks)))
        return seeds

    @staticmethod
    def _keep_seeds(seeds: list[tuple], layer: int, k: torch.Tensor, v: torch.Tensor, firsts: list[int],
                    prefix_of: dict) -> None:
        """Copy each seed row's keys and values of `layer` (k, v: [rows, KV, T, d] of the pass, after the
        row's prefix of firsts[row] positions) out of the batch: [KV, m, d], its prefix's in front."""
        for row, m, keys, values in seeds:
            first = firsts[row]
            mine_k, mine_v = k[row, :, :m - first], v[row, :, :m - first]
            if first:
                _, prefix_k, prefix_v, _ = prefix_of[row]
                keys[layer] = torch.cat([prefix_k[layer][:, :first], mine_k], dim=1)
                values[layer] = torch.cat([prefix_v[layer][:, :first], mine_v], dim=1)
            else:
                keys[layer] = mine_k.clone(memory_format=torch.contiguous_format)
                values[layer] = mine_v.clone(memory_format=torch.contiguous_format)

    def _insert_seeds(self, groups: list[SequenceGroup], seeds: list[tuple], hidden: torch.Tensor,
                      firsts: list[int], prefix_of: dict) -> None:
        """Put the seed rows' keys, values and final-normed hidden states ([rows, T, D] of the pass, after
        each row's prefix) into the prefix cache."""
        for row, m, keys, values in seeds:
            first = firsts[row]
            mine = hidden[row, :m - first]
            states = torch.cat([prefix_of[row][3][:first], mine]) if first else mine
            self.prefix_cache.insert(groups[row].prompt_ids[:m], keys, values, states)

    @property
    def kv_cache_bytes(self) -> int:
        return self.cache.nbytes

    @property
    def prefix_cache_bytes(self) -> int:
        return self.prefix_cache.nbytes

    def on_idle(self) -> None:
        self.cache.shrink()
        self.graphs.clear()

    def prefill_progress(self, group: SequenceGroup) -> int:
        return group.cache.done if isinstance(group.cache, PrefillState) else 0

    @torch.inference_mode()
    def prefill_chunks(self, chunks: list[tuple[SequenceGroup, int]]) -> list[torch.Tensor | None]:
        """The next chunk of several prompts in one forward pass: their tokens packed into one sequence,
        each attending only to its own prompt (a block-diagonal causal mask over the keys of each
        prompt so far). One read of the weights for all of them instead of one per prompt."""
        if len(chunks) == 1:
            return [self.prefill_chunk(*chunks[0])]
        parts = []  # (group, state, start, stop)
        for group, budget in chunks:
            if group.cache is None:
                group.cache = PrefillState(self, group)
                if group.params.needs_prompt_logits:
                    group.prompt_columns = self.new_prompt_columns(group.num_prompt_tokens, group.params)
            state = group.cache
            start = state.done
            parts.append((group, state, start, min(group.num_prompt_tokens, start + max(1, budget))))
        ids = torch.cat([state.ids[start:stop] for _, state, start, stop in parts])[None]
        positions = torch.cat([torch.arange(start, stop, device=self.device) for _, _, start, stop in parts])[None]
        num_queries, num_keys = ids.shape[1], sum(stop for *_, stop in parts)
        masks = {w: torch.zeros(num_queries, num_keys, dtype=torch.bool, device=self.device)
                 for w in [None, *self.window_sizes]}
        q0 = k0 = 0
        for _, _, start, stop in parts:
            n = stop - start
            blocks = self._bands(torch.ones(n, stop, dtype=torch.bool, device=self.device).tril(start), start)
            for w, mask in masks.items():
                mask[q0:q0 + n, k0:k0 + stop] = blocks[w]
            q0, k0 = q0 + n, k0 + stop
        masks = self._additive(masks)
        windows = self.windows

        def attend(layer, q, k, v):
            q0 = 0
            for _, state, start, stop in parts:
                state.keys[layer][:, start:stop] = k[0, :, q0:q0 + stop - start]
                state.values[layer][:, start:stop] = v[0, :, q0:q0 + stop - start]
                q0 += stop - start
            keys = torch.cat([state.keys[layer][:, :stop] for _, state, _, stop in parts], dim=1)[None]
            values = torch.cat([state.values[layer][:, :stop] for _, state, _, stop in parts], dim=1)[None]
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=masks[windows[layer]], scale=self.scale,
                                                  enable_gqa=self.kv_heads != self.num_heads)

        segments, q0 = [], 0
        for group, _, start, stop in parts:
            segments.append((0, q0, q0 + stop - start, group.edits))
            q0 += stop - start
        hidden = self._run(ids, positions, attend, edit=segment_editor(segments))[0]  # [sum of chunks, D]
        out, q0 = [], 0
        finished = []
        for group, state, start, stop in parts:
            h = hidden[q0:q0 + stop - start]
            q0 += stop - start
            if group.prompt_columns is not None:
                self.fill_prompt_columns(group.prompt_columns, h, state.ids, start)
            state.done = stop
            if stop < group.num_prompt_tokens:
                out.append(None)
            else:
                out.append(len(finished))
                finished.append(h[-1])
        if finished:
            lsm = self.logprobs_of(torch.stack(finished))
            out = [None if o is None else lsm[o:o + 1] for o in out]
        return out

    def reset(self) -> None:
        """Forget every row and start from a new cache of the first size (after a failed step: the
        engine has failed every group that held a row); the prefix cache is emptied too."""
        self.graphs.clear()
        self.prefix_cache.clear()  # nothing kept from a step that failed
        self.cache = SlabCache(len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.device,
                               max_len=self.cache.max_len, capacity=self.kv_positions)

    def is_consistent(self, running: list[SequenceGroup]) -> bool:
        """Whether the cache's bookkeeping is whole and holds exactly the running groups' rows, each where
        its handle says."""
        rows = [(g, row) for g in running for row in getattr(g, "rows", ())]
        return self.cache.is_consistent() and self.cache.num_rows == len(rows) and \
            all(row.group is g and self.cache.holds(row) for g, row in rows)

    @torch.inference_mode()
    def expand(self, group: SequenceGroup, rows: int) -> None:
        """The prompt is done: give each choice a slot holding the prompt's keys and values."""
        state = group.cache
        group.rows = []
        handles = [Row(group, seq_index) for seq_index in group.active_rows]
        self.cache.add(handles, state.keys, state.values)  # all of them, or none (then nothing to release)
        group.rows = handles
        group.cache = None

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

    def _decode(self, groups: list[SequenceGroup], k: int | None) -> tuple[list[torch.Tensor], np.ndarray | None]:
        cache = self.cache
        if cache.num_rows != sum(len(g.rows) for g in groups):
            raise RuntimeError("the KV cache is out of step with the running groups")
        cache.make_room()  # a row whose size class is full moves into the next one
        slabs = [slab for slab in cache.slabs.values() if slab.rows]
        rows = [r for slab in slabs for r in slab.rows]  # the batch: slab by slab, slot order within each
        table = np.array([(r.group.sequences[r.seq_index].token_ids[-1], r.length) for r in rows], dtype=np.int64)
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
        lsm = picked = None
        if static:
            lsm, picked = self._decode_static(slabs[0], inputs, picking, max(r.length for r in rows) + 1)
        if lsm is None:
            lsm = self._decode_eager(slabs, rows, inputs[:, :2])
        for r in rows:
            r.length += 1
        offsets = {slab.capacity: start for slab, start in zip(slabs, np.cumsum([0] + [len(s.rows) for s in slabs]))}
        orders = [[int(offsets[row.slab]) + row.slot for row in group.rows] for group in groups]
        host = None
        if picked is not None:
            host = picked.cpu().numpy()  # the step's one transfer
            host = host[[i for order in orders for i in order]]
        return self._by_group(orders, lsm), host

    def _by_group(self, orders: list[list[int]], lsm: torch.Tensor) -> list[torch.Tensor]:
        """Each group's rows of the batch's log probabilities (`orders`: per group, its rows' places in
        the batch, in the order of its rows): slices where a group's rows are consecutive in the batch
        (the usual case), else one gather for all groups with an index moved in one copy (a list index
        would copy to the device once per group)."""
        if all(order == list(range(order[0], order[0] + len(order))) for order in orders if order):
            return [lsm[order[0]:order[0] + len(order)] if order else lsm[:0] for order in orders]
        gathered = lsm.index_select(0, to_device([i for order in orders for i in order], torch.int64, self.device))
        return list(torch.split(gathered, [len(order) for order in orders]))

    def _decode_eager(self, slabs, rows, inputs: torch.Tensor) -> torch.Tensor:
        """The decode pass over each slab's view of the positions held so far (`[:n, :, :longest]`)."""
        count = len(rows)
        ids, lengths = inputs[:, :1], inputs[:, 1]
        # per slab: (slab, its first batch row, rows, longest, same, lengths, slots, {window: (first, mask)})
        parts, start = [], 0
        for slab in slabs:
            n = len(slab.rows)
            longest = max(r.length for r in slab.rows) + 1
            part_lengths = lengths if n == count else lengths[start:start + n]
            same = all(r.length == longest - 1 for r in slab.rows)  # rows in step: no mask, no scatter
            slots = None if same else torch.arange(n, device=self.device)
            columns = None if same else torch.arange(longest, device=self.device)[None, :]
            mask = None if same else (columns <= part_lengths[:, None])[:, None, None, :]
            # per window: (first key position read, mask); full-attention layers read from 0 with `mask`
            views = {None: (0, mask)}
            for window in self.window_sizes:
                if longest <= window:  # no row is past the window yet
                    views[window] = (0, mask)
                elif same:  # every row sees exactly the last `window` positions
                    views[window] = (longest - window, None)
                else:
                    views[window] = (0, (mask & (columns > (part_lengths - window)[:, None])[:, None, None, :]))
            masks = self._additive({w: mask for w, (_, mask) in views.items()})
            views = {w: (first, masks[w]) for w, (first, _) in views.items()}
            parts.append((slab, start, n, longest, same, part_lengths, slots, views))
            start += n
        windows = self.windows
        kv_heads, group = self.kv_heads, self.num_heads // self.kv_heads

        def attend(layer, q_all, k_all, v_all):
            outs = []
            for slab, first_row, n, longest, same, part_lengths, slots, views in parts:
                q, k, v = (q_all, k_all, v_all) if n == count else \
                    (q_all[first_row:first_row + n], k_all[first_row:first_row + n], v_all[first_row:first_row + n])
                keys, values = slab.keys[layer][:n], slab.values[layer][:n]
                if same:  # k, v [n, KV, 1, d] go to the one position every row is at
                    keys.narrow(2, longest - 1, 1).copy_(k)
                    values.narrow(2, longest - 1, 1).copy_(v)
                else:
                    keys[slots, :, part_lengths] = k[:, :, 0]
                    values[slots, :, part_lengths] = v[:, :, 0]
                first, mask = views[windows[layer]]
                keys, values = keys.narrow(2, first, longest - first), values.narrow(2, first, longest - first)
                # One query per row: each key/value head's query heads attend as that head's queries
                # ([B, KV, H/KV, d] against [B, KV, L, d]), the same products as enable_gqa without its
                # expansion of the keys, which in bfloat16 cost 10x (0.78 vs 0.08 ms for 16 rows of 80
                # positions, 7.4 vs 0.53 ms for 600: 4 query heads on 1 key head, d 256).
                outs.append(F.scaled_dot_product_attention(q.reshape(n, kv_heads, group, -1), keys, values,
                                                           attn_mask=mask, scale=self.scale))
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
            return out.reshape(count, kv_heads * group, 1, -1)

        edit = segment_editor([(i, 0, 1, r.group.edits) for i, r in enumerate(rows)])
        hidden = self._run(ids, lengths[:, None], attend, decode=True, edit=edit)[:, -1]  # [rows, D]
        return self.logprobs_of(hidden)

    STATIC_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    MAX_GRAPHS = 8  # captured decode steps kept (each holds its own working memory on the device)

    SPANS = 4  # a fixed-shape step attends over the first 1/4, 2/4, 3/4 or all of its slab's capacity

    def _decode_static(self, slab, inputs: torch.Tensor, picking: tuple[int, bool] | None, longest: int
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The decode pass in fixed shapes for a batch held in one slab: the batch padded to the next
        size in STATIC_BATCHES (padding rows write into the slab's unused slots, at position 0), and
        attention over a span of the slab's positions with a length mask (and each sliding window's
        band): the first quarter, half, three quarters or all of its capacity, the least that holds the
        batch's `longest` row after this step's position (past the first class a row's class is at most
        twice its length, so a span reads less than 1.5 times what the longest row holds, where the
        whole capacity read up to twice). So one CUDA graph per (padded batch, slab, span, picking)
        replays every step until the slab changes or the longest row crosses into the next span. With
        `picking` = (k, whether any row is drawn), `inputs` carries the rows' sampling settings after
        their token and position, and the pass ends with `sampler.pick`. On a CPU the same pass runs
        eagerly, over the tensors its step was made on, as a replayed graph does (so the tests see a step
        kept past a change of its slab). (log probabilities [rows, V], the pick [rows, 2 + 2k] or None);
        (None, None) where the slab has too few slots for the padding."""
        count = inputs.shape[0]
        batch = next((b for b in self.STATIC_BATCHES if b >= count), None)
        if batch is None or batch > slab.num_slots:
            return None, None
        for key in [k for k, step in self.graphs.items() if not step.holds(self.cache)]:
            del self.graphs[key]  # its slab was replaced or dropped: its tensors go with it
        quarter = max(1, slab.capacity // self.SPANS)
        span = min(slab.capacity, -(-longest // quarter) * quarter)
        key = (batch, id(slab), span, picking)
        step = self.graphs.get(key)
        if step is None:
            step = StaticStep(self, slab, batch, picking, span)
            while len(self.graphs) >= self.MAX_GRAPHS:
                del self.graphs[next(iter(self.graphs))]
            self.graphs[key] = step
        step.load(inputs)
        lsm, picked = step.run()
        return lsm[:count], None if picked is None else picked[:count]

    @property
    def compile_step(self) -> str | None:
        return self._compile_step

    @compile_step.setter
    def compile_step(self, backend: str | None) -> None:
        if backend is not None and torch.__version__ < COMPILE_MIN_TORCH:
            raise RuntimeError(f"compile_step needs torch >= {'.'.join(map(str, COMPILE_MIN_TORCH))}, the "
                               f"lowest version its tests pass on; this is torch {torch.__version__}")
        self._compile_step = backend

    def static_pass(self):
        """`_static_pass`, or its torch.compile'd form where `compile_step` names a backend: the whole
        pass traced as one graph (a graph break fails loudly), compiled at its first call (which a GPU
        makes before recording the CUDA graph) and again for new shapes (dynamic after the second)."""
        backend = self.compile_step
        if backend is None:
            return self._static_pass
        if backend not in self._compiled:
            _counters(self.vocab_size, self.device)  # the sampler's cached constants, made outside the trace
            self._compiled[backend] = torch.compile(self._static_pass, backend=backend, fullgraph=True)
        return self._compiled[backend]

    def _static_pass(self, keys: list[torch.Tensor], values: list[torch.Tensor], ids: torch.Tensor,
                     lengths: torch.Tensor, settings: torch.Tensor | None = None,
                     picking: tuple[int, bool] | None = None, span: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fixed-shape decode pass itself (what a CUDA graph records) over a slab's per-layer keys and
        values ([S, KV, capacity, D]), attending over their first `span` positions (None: all):
        [batch, V] log probabilities, and with `picking` = (k, sampled) the rows' pick from their
        `settings` (sampler.BatchSettings.table's columns) or None."""
        batch, capacity = ids.shape[0], span or keys[0].shape[2]
        slots = torch.arange(batch, device=self.device)
        columns = torch.arange(capacity, device=self.device)[None, :]
        mask = columns <= lengths[:, None]
        masks = {None: mask[:, None, None, :]}
        for window in self.window_sizes:
            masks[window] = (mask & (columns > (lengths - window)[:, None]))[:, None, None, :]
        masks = self._additive(masks)
        windows = self.windows
        kv_heads, group = self.kv_heads, self.num_heads // self.kv_heads

        def attend(layer, q, k, v):
            keys[layer][slots, :, lengths] = k[:, :, 0]
            values[layer][slots, :, lengths] = v[:, :, 0]
            out = F.scaled_dot_product_attention(q.reshape(batch, kv_heads, group, -1),
                                                 keys[layer][:batch, :, :capacity], values[layer][:batch, :, :capacity],
                                                 attn_mask=masks[windows[layer]], scale=self.scale)
            return out.reshape(batch, kv_heads * group, 1, -1)

        lsm = self.logprobs_of(self._run(ids, lengths[:, None], attend, decode=True)[:, -1])
        if picking is None:
            return lsm, None
        k, sampled = picking
        chosen = BatchSettings.on_device(settings, 0, False) if sampled else BatchSettings.all_greedy_rows()
        return lsm, pick(lsm, chosen, k)

    @torch.inference_mode()
    def select(self, group: SequenceGroup, keep: list[int]) -> None:
        kept = []
        for position, row in enumerate(group.rows):
            if position in keep:
                kept.append(row)
            else:
                self.cache.remove(row)
        group.rows = kept

    @torch.inference_mode()
    def release(self, group: SequenceGroup) -> None:
        for row in getattr(group, "rows", None) or []:
            if row.slot >= 0:
                self.cache.remove(row)
        group.rows = []
        group.cache = None


def copy_rows(source: PromptColumns, target: PromptColumns, start: int, stop: int) -> None:
    """Rows start..stop-1 of every per-position array of `source` into `target` (same settings)."""
    for name in ("logprobs", "ranks", "top_ids", "top_logprobs", "full", "full_ranks"):
        array = getattr(source, name)
        if array is not None:
            getattr(target, name)[start:stop] = array[start:stop]
    if source.extras is not None:
        for name, array in vars(source.extras).items():
            if isinstance(array, np.ndarray) and name != "token_ids":
                getattr(target.extras, name)[start:stop] = array[start:stop]


def shared_prefixes(prompts: list[list[int]], minimum: int) -> list[tuple[int, list[int]]]:
    """[(prefix length, indices of the prompts that begin with it)] for runs of at least two prompts whose
    common first tokens number at least `minimum`; each prompt keeps one token of its own at least (the
    state before it predicts it). Prompts are taken in sorted order, so a context's continuations meet
    whatever order they came in."""
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    clusters, run, length = [], [], 0
    for i in order:
        if run:
            common = _common(prompts[run[0]], prompts[i], min(length, len(prompts[i]) - 1))
            if common >= minimum:
                run.append(i)
                length = common
                continue
            if len(run) > 1:
                clusters.append((length, run))
        run, length = [i], len(prompts[i]) - 1
    if len(run) > 1:
        clusters.append((length, run))
    return clusters


def _common(a: list[int], b: list[int], limit: int) -> int:
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n


class StaticStep:
    """One fixed-shape decode step: its input buffers, and on a GPU the CUDA graph that replays it. It
    keeps the slab's tensors it was recorded on (so their memory cannot be reused under it), and is
    dropped as soon as the slab holds other tensors."""

    def __init__(self, runner: FastRunner, slab, batch: int, picking: tuple[int, bool] | None = None,
                 span: int | None = None):
        self.runner, self.slab, self.batch, self.picking, self.span = runner, slab, batch, picking, span
        self.tensors = (list(slab.keys), list(slab.values))
        # the step's inputs: token, position, then (when it picks) BatchSettings.table's columns; padding
        # rows take token 0 at position 0 and are greedy (temperature 1: nothing divides by 0)
        width = 2 if picking is None else 2 + SETTINGS_COLUMNS
        self.padding = torch.zeros(width, dtype=torch.int64)
        if picking is not None:
            self.padding[2:] = torch.from_numpy(BatchSettings.table([SamplingParams(temperature=0.0)], 1, None)[0])
        self.padding = self.padding.to(runner.device)
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
        return self.runner.static_pass()(*self.tensors, inputs[:, :1], inputs[:, 1], inputs[:, 2:], self.picking,
                                         self.span)

    def run(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        runner = self.runner
        if runner.device.type != "cuda":
            return self._pass()
        if self.graph is None:
            # Record after one pass on a side stream (kernels choose their algorithms there). Both write
            # the same keys and values at the same positions as the replay below.
            side = torch.cuda.Stream(runner.device)
            side.wait_stream(torch.cuda.current_stream(runner.device))
            with torch.cuda.stream(side):
                self._pass()
            torch.cuda.current_stream(runner.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.out = self._pass()
            self.graph = graph
        self.graph.replay()
        return self.out
