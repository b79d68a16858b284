"""The device work: prefill and decode forward passes over a transformers causal LM with a KV cache.

Only the engine's thread calls a `ModelRunner`. Logits for every prompt position are computed only for
groups that need them, in chunks of positions so that a long prompt never holds a [P, V] float32 matrix;
each chunk is reduced on the device to what the API reports (the target's log probability, its rank and
the top-k) before anything moves to numpy.
"""

from __future__ import annotations

import contextlib
import inspect

import numpy as np
import torch
from transformers import DynamicCache

from .instruments import count_greater, fill_prompt_extras, new_prompt_extras
from .interventions import Edits, segment_editor
from .request import PromptColumns, SamplingParams, SequenceGroup

POSITION_CHUNK = 256  # prompt positions whose logits are materialised at once, at most
CHUNK_ENTRIES = 256 * 49_152  # ... and at most this many logits (positions x vocabulary): 48 positions
# for Gemma 3's 262,144 tokens, whose working memory at 256 positions measured 3.49 GB against 0.69 GB


class CacheIgnored(RuntimeError):
    """transformers ran a forward pass without growing the KV cache it was given."""


def cache_keyword(decoder) -> str:
    """The name under which this transformers version's decoder takes a KV cache: `cache` from 5.24,
    `past_key_values` before (5.24 still accepts the old name with a warning until 5.40). Read from the
    forward's signature, because a wrong name is not an error: `**kwargs` swallows it and the pass runs
    without a cache."""
    params = inspect.signature(decoder.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise RuntimeError(f"{type(decoder).__name__}.forward takes neither `cache` nor `past_key_values`: "
                       "this transformers version is not supported")


def check_cache_length(cache, expected: int) -> None:
    """A keyword the decoder ignored would leave the cache empty and every later token wrong: fail loudly."""
    held = cache.get_seq_length()
    if held != expected:
        raise CacheIgnored(f"the KV cache holds {held} positions after a pass that should leave {expected}: "
                           "transformers ignored the cache argument")


class _Captured(Exception):
    """Raised by the last activation hook: the rest of the forward pass is not needed."""


def vocab_ranks(rows: torch.Tensor) -> torch.Tensor:
    """Rank of every entry of [B, V] rows: 1 + the number of strictly larger values in its row.
    One sort per row; equal values share the rank of the first of their run."""
    values, order = torch.sort(rows, dim=-1, descending=True)
    starts_run = torch.ones_like(values, dtype=torch.bool)
    starts_run[:, 1:] = values[:, 1:] != values[:, :-1]
    index = torch.arange(rows.shape[-1], device=rows.device).expand_as(order)
    first = torch.cummax(torch.where(starts_run, index, torch.zeros_like(index)), dim=-1).values
    return torch.empty_like(first).scatter_(-1, order, first + 1)


class ModelRunner:
    def __init__(self, model):
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device
        self.decoder = getattr(model, model.base_model_prefix)
        self.lm_head = model.get_output_embeddings()
        self.vocab_size = int(self.lm_head.weight.shape[0])  # the lean path may empty the module later
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        self.cache_kw = cache_keyword(self.decoder)

    @contextlib.contextmanager
    def edited(self, edit, positions: torch.Tensor):
        """Hooks that apply `edit(layer, x, positions)` (interventions.py) to the residual stream entering
        block 0 and leaving each block, while the block is inside; nothing is hooked when edit is None."""
        if edit is None:
            yield
            return
        handles = []

        def pre_hook(module, args, kwargs):
            if args:
                return (edit(0, args[0], positions), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": edit(0, kwargs["hidden_states"], positions)}

        def hook(module, inputs, output, layer):
            if isinstance(output, tuple):
                return (edit(layer, output[0], positions), *output[1:])
            return edit(layer, output, positions)

        try:
            # prepended: an activation hook on the same block sees the stream as the edit left it
            handles.append(self.decoder.layers[0].register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=True))
            for index, block in enumerate(self.decoder.layers):
                handles.append(block.register_forward_hook(lambda m, i, o, layer=index + 1: hook(m, i, o, layer),
                                                           prepend=True))
            yield
        finally:
            for h in handles:
                h.remove()

    def logprobs_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """Raw next-token log probabilities, float32, for hidden states [..., D]."""
        logits = self.lm_head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return torch.log_softmax(logits, dim=-1)

    @torch.inference_mode()
    def prefill(self, group: SequenceGroup) -> torch.Tensor:
        """Run the prompt, keep its KV cache on the group, fill its prompt columns if asked, and return
        the log probabilities of the first token to generate ([1, V])."""
        ids = torch.tensor([group.prompt_ids], dtype=torch.long, device=self.device)
        cache = DynamicCache(config=self.config)
        positions = torch.arange(ids.shape[1], device=self.device)[None]
        with self.edited(segment_editor([(0, 0, ids.shape[1], group.edits)]), positions):
            hidden = self.decoder(input_ids=ids, use_cache=True, **{self.cache_kw: cache}).last_hidden_state[0]  # [P, D]
        check_cache_length(cache, ids.shape[1])
        group.cache = cache
        if group.params.needs_prompt_logits:
            group.prompt_columns = self._prompt_columns(hidden, ids[0], group.params)
        return self.logprobs_of(hidden[-1:])

    @torch.inference_mode()
    def prefill_batch(self, groups: list[SequenceGroup]) -> None:
        """One forward pass for several prompt-only groups (right-padded, with an attention mask) that
        fills each group's prompt columns. No KV cache is kept: nothing is generated."""
        if len(groups) == 1:
            self.prefill(groups[0])
            groups[0].cache = None
            return
        longest = max(g.num_prompt_tokens for g in groups)
        ids = torch.zeros((len(groups), longest), dtype=torch.long, device=self.device)
        mask = torch.zeros((len(groups), longest), dtype=torch.long, device=self.device)
        for row, g in enumerate(groups):
            ids[row, :g.num_prompt_tokens] = torch.tensor(g.prompt_ids, dtype=torch.long)
            mask[row, :g.num_prompt_tokens] = 1
        positions = torch.arange(longest, device=self.device)[None].expand(len(groups), -1)
        edit = segment_editor([(row, 0, longest, g.edits) for row, g in enumerate(groups)])
        with self.edited(edit, positions):
            hidden = self.decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        for row, g in enumerate(groups):
            if g.params.needs_prompt_logits:
                n = g.num_prompt_tokens
                g.prompt_columns = self._prompt_columns(hidden[row, :n], ids[row, :n], g.params)

    def _prompt_columns(self, hidden: torch.Tensor, ids: torch.Tensor, params: SamplingParams) -> PromptColumns:
        cols = self.new_prompt_columns(ids.shape[0], params)
        self.fill_prompt_columns(cols, hidden, ids, 0)
        return cols

    def new_prompt_columns(self, num: int, params: SamplingParams) -> PromptColumns:
        """Empty columns for a prompt of `num` tokens, as wide as the request asks."""
        k = params.num_prompt_top
        vocab = self.vocab_size
        full = full_ranks = None
        if params.prompt_logprobs == -1:  # bounded by the whole-vocabulary cap (256 positions by default)
            full = np.full((num, vocab), np.nan, dtype=np.float32)
            full_ranks = np.zeros((num, vocab), dtype=np.int32)
        return PromptColumns(np.full(num, np.nan, dtype=np.float32), np.zeros(num, dtype=np.int64),
                             np.zeros((num, k), dtype=np.int64), np.zeros((num, k), dtype=np.float32),
                             full, full_ranks, new_prompt_extras(num, params, vocab))

    def fill_prompt_columns(self, cols: PromptColumns, hidden: torch.Tensor, ids: torch.Tensor, first: int) -> None:
        """Fill the rows predicted by `hidden` ([C, D], the states at positions first..first+C-1): the
        distribution at position i predicts the prompt token at i + 1."""
        num, k = ids.shape[0], cols.top_ids.shape[1]
        last = min(first + hidden.shape[0], num - 1)  # the state at the final position predicts no prompt token
        chunk = max(1, min(POSITION_CHUNK, CHUNK_ENTRIES // self.vocab_size))
        for start in range(first, last, chunk):
            stop = min(start + chunk, last)
            lsm = self.logprobs_of(hidden[start - first:stop - first])  # [C, V]
            target = ids[start + 1:stop + 1]
            target_lp = lsm.gather(1, target[:, None])  # [C, 1]
            cols.logprobs[start + 1:stop + 1] = target_lp[:, 0].cpu().numpy()
            if cols.full is not None:
                cols.full[start + 1:stop + 1] = lsm.cpu().numpy()
                cols.full_ranks[start + 1:stop + 1] = vocab_ranks(lsm).cpu().numpy()
            cols.ranks[start + 1:stop + 1] = (count_greater(lsm, target_lp) + 1).cpu().numpy()
            if k:
                vals, idx = torch.topk(lsm, k, dim=1)
                cols.top_ids[start + 1:stop + 1] = idx.cpu().numpy()
                cols.top_logprobs[start + 1:stop + 1] = vals.cpu().numpy()
            if cols.extras is not None:
                fill_prompt_extras(cols.extras, lsm, slice(start + 1, stop + 1))

    @torch.inference_mode()
    def decode(self, group: SequenceGroup, last_tokens: list[int]) -> torch.Tensor:
        """One decode step for the group's active rows; returns their log probabilities [B, V]."""
        ids = torch.tensor(last_tokens, dtype=torch.long, device=self.device)[:, None]
        held = group.cache.get_seq_length()
        positions = torch.full((ids.shape[0], 1), held, dtype=torch.long, device=self.device)
        edit = segment_editor([(row, 0, 1, group.edits) for row in range(ids.shape[0])])
        with self.edited(edit, positions):
            hidden = self.decoder(input_ids=ids, use_cache=True, **{self.cache_kw: group.cache}).last_hidden_state
        check_cache_length(group.cache, held + 1)
        return self.logprobs_of(hidden[:, -1])

    @torch.inference_mode()
    def residual_stream(self, ids: list[int], layers: list[int], edits: Edits | None = None) -> dict[int, np.ndarray]:
        """Run `ids` once without a cache (under a request's `edits` where it has them) and return
        {layer: [len(ids), D] float32} from hooks on just the asked layers (nothing is hooked for
        requests that do not ask). Layer 0 is the input to block 0 (the embeddings, scaled where the
        model scales them); layer l >= 1 is block l's output, the residual stream before the final
        norm. The pass stops after the deepest asked layer."""
        store: dict[int, torch.Tensor] = {}
        deepest = max(layers)
        handles = []

        def keep(layer, hidden):
            store[layer] = hidden[0].float().cpu()
            if layer == deepest:
                raise _Captured

        try:
            for layer in sorted(set(layers)):
                if layer == 0:
                    def pre_hook(module, args, kwargs):
                        keep(0, args[0] if args else kwargs["hidden_states"])

                    handles.append(self.decoder.layers[0].register_forward_pre_hook(pre_hook, with_kwargs=True))
                else:
                    def hook(module, inputs, output, layer=layer):
                        keep(layer, output[0] if isinstance(output, tuple) else output)

                    handles.append(self.decoder.layers[layer - 1].register_forward_hook(hook))
            positions = torch.arange(len(ids), device=self.device)[None]
            with self.edited(segment_editor([(0, 0, len(ids), edits)]), positions):
                self.decoder(input_ids=torch.tensor([ids], dtype=torch.long, device=self.device), use_cache=False)
        except _Captured:
            pass
        finally:
            for h in handles:
                h.remove()
        return {layer: store[layer].numpy() for layer in store}

    def apply_final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's final norm (what its last block's output goes through before the head)."""
        return self.decoder.norm(hidden)

    @torch.inference_mode()
    def logit_lens(self, ids: list[int], layers: list[int], k: int, edits: Edits | None = None) -> dict[int, PromptColumns]:
        """{layer: columns of `ids`} with each asked layer's residual stream read as if it were the last
        block's output: the final norm, the head, log_softmax in float32. Row i holds token i's log
        probability and rank under the state at position i - 1 and the k likeliest tokens there (row 0
        is empty), reduced chunk by chunk as prompt log probabilities are."""
        states = self.residual_stream(ids, layers, edits)
        dtype = self.head_dtype()
        target = torch.tensor(ids, dtype=torch.long, device=self.device)
        params = SamplingParams(prompt_logprobs=k)
        out = {}
        for layer in layers:
            hidden = torch.from_numpy(states[layer]).to(self.device, dtype)  # float32 of the model's values
            cols = self.new_prompt_columns(len(ids), params)
            self.fill_prompt_columns(cols, self.apply_final_norm(hidden), target, 0)
            out[layer] = cols
        return out

    def head_dtype(self) -> torch.dtype:
        """The dtype the final norm and the head take."""
        return next(self.model.parameters()).dtype

    # ---- the interface the engine's step loop uses (the fast runner implements the same) -------
    supports_batched_decode = False

    def prefill_chunk(self, group: SequenceGroup, budget: int) -> torch.Tensor | None:
        """Advance the group's prefill; the log probabilities of its first token ([1, V]) when the
        prompt is done, else None. This runner does the whole prompt at once."""
        return self.prefill(group)

    def prefill_chunks(self, chunks: list[tuple[SequenceGroup, int]]) -> list[torch.Tensor | None]:
        """`prefill_chunk` for each (group, budget); a runner may run them in one pass."""
        return [self.prefill_chunk(group, budget) for group, budget in chunks]

    kv_cache_bytes = 0  # this runner keeps a cache per request, inside the request
    prefix_cache_bytes = 0  # ... and no prefix cache (the lean path's, prefix_cache.py)

    def on_idle(self) -> None:
        """Called when the engine has nothing to do."""

    def prefill_progress(self, group: SequenceGroup) -> int:
        """Prompt tokens of the group already prefilled (this runner prefills a prompt in one go)."""
        return 0

    def decode_groups(self, groups: list[SequenceGroup]) -> list[torch.Tensor]:
        """One decode step for every active row of these groups: [rows, V] per group."""
        return [self.decode(g, [g.sequences[i].token_ids[-1] for i in g.active_rows]) for g in groups]

    def decode_and_pick(self, groups: list[SequenceGroup], k: int) -> tuple[list[torch.Tensor], np.ndarray | None]:
        """`decode_groups`, and where the runner can pick the rows' tokens in the same recorded pass (a
        CUDA graph on the lean path), what the engine would bring to the host for them (sampler.pick's
        array, rows in the groups' order, their rows in order within each); None where it cannot: the
        engine picks them itself."""
        return self.decode_groups(groups), None

    @staticmethod
    def expand(group: SequenceGroup, rows: int) -> None:
        if rows > 1:
            group.cache.batch_repeat_interleave(rows)

    @staticmethod
    def select(group: SequenceGroup, keep: list[int]) -> None:
        group.cache.batch_select_indices(torch.tensor(keep, dtype=torch.long))

    def release(self, group: SequenceGroup) -> None:
        group.cache = None

    def reset(self) -> None:
        """Drop shared state after a failed step (this runner keeps none: each cache is its request's)."""

    def is_consistent(self, running: list[SequenceGroup]) -> bool:
        return all(g.cache is not None for g in running)
