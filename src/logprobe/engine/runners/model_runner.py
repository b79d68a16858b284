"""The device work on transformers' forward: prefill and decode passes over a transformers causal LM
with its own KV cache per request, for models the lean runner (lean/) does not run.

Only the engine's thread calls a `ModelRunner`. Prompt columns are reduced by prompt_columns.py, which
the lean runner uses too.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Iterator

import numpy as np
import torch
from transformers import DynamicCache

from .interventions import Edits, segment_editor
from .prompt_columns import CaptureDone, PromptColumnWriter, logit_lens
from ..host.request import PromptColumns, SequenceGroup


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


class ModelRunner:
    prefix_cache = None  # it keeps no prefix cache: a prompt runs whole each time

    def __init__(self, model):
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device
        self.decoder = getattr(model, model.base_model_prefix)
        self.lm_head = model.get_output_embeddings()
        self.vocab_size = int(self.lm_head.weight.shape[0])
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        self.cache_kw = cache_keyword(self.decoder)
        self.columns = PromptColumnWriter(self.logprobs_of, self.vocab_size)
        self.caches: dict[SequenceGroup, DynamicCache] = {}  # each running group's cache (transformers')
        self.columns_of: dict[SequenceGroup, PromptColumns] = {}  # prompt columns until handed over

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
        """Run the prompt, keep its KV cache for the group, make its prompt columns if asked, and return
        the log probabilities of the first token to generate ([1, V])."""
        ids = torch.tensor([group.prompt_ids], dtype=torch.long, device=self.device)
        cache = DynamicCache(config=self.config)
        positions = torch.arange(ids.shape[1], device=self.device)[None]
        with self.edited(segment_editor([(0, 0, ids.shape[1], group.edits)]), positions):
            hidden = self.decoder(input_ids=ids, use_cache=True, **{self.cache_kw: cache}).last_hidden_state[0]  # [P, D]
        check_cache_length(cache, ids.shape[1])
        self.caches[group] = cache
        if group.params.needs_prompt_logits:
            self.columns_of[group] = self.columns.whole(hidden, ids[0], group.params)
        return self.logprobs_of(hidden[-1:])

    @torch.inference_mode()
    def prefill_batch(self, groups: list[SequenceGroup]) -> None:
        """One forward pass for several prompt-only groups (right-padded, with an attention mask) that
        makes each group's prompt columns. No KV cache is kept: nothing is generated."""
        if len(groups) == 1:
            self.prefill(groups[0])
            self.caches.pop(groups[0], None)
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
                self.columns_of[g] = self.columns.whole(hidden[row, :n], ids[row, :n], g.params)

    @torch.inference_mode()
    def decode(self, group: SequenceGroup, last_tokens: list[int]) -> torch.Tensor:
        """One decode step for the group's active rows; returns their log probabilities [B, V]."""
        ids = torch.tensor(last_tokens, dtype=torch.long, device=self.device)[:, None]
        cache = self.caches[group]
        held = cache.get_seq_length()
        positions = torch.full((ids.shape[0], 1), held, dtype=torch.long, device=self.device)
        edit = segment_editor([(row, 0, 1, group.edits) for row in range(ids.shape[0])])
        with self.edited(edit, positions):
            hidden = self.decoder(input_ids=ids, use_cache=True, **{self.cache_kw: cache}).last_hidden_state
        check_cache_length(cache, held + 1)
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
                raise CaptureDone

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
        except CaptureDone:
            pass
        finally:
            for h in handles:
                h.remove()
        return {layer: store[layer].numpy() for layer in store}

    def apply_final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's final norm (what its last block's output goes through before the head)."""
        return self.decoder.norm(hidden)

    @torch.inference_mode()
    def logit_lens(self, ids: list[int], layers: list[int], k: int, edits: Edits | None = None
                   ) -> dict[int, PromptColumns]:
        """{layer: columns of `ids`} from each asked layer's residual stream (prompt_columns.logit_lens)."""
        return logit_lens(self, ids, layers, k, edits)

    def head_dtype(self) -> torch.dtype:
        """The dtype the final norm and the head take."""
        return next(self.model.parameters()).dtype

    # ---- the runner contract (contract.py; the lean runner implements the same) ----------------
    prefill_chunk_tokens = None  # a prompt is prefilled whole
    interleaves = False  # a prompt-only pass runs whole, in the step that starts it

    def prompt_pass(self, groups: list[SequenceGroup], hits: list | None = None) -> Iterator[int]:
        """`prefill_batch` as the contract's steps: the whole pass at the first, no point between (no hits:
        this runner keeps no prefix cache)."""
        self.prefill_batch(groups)
        yield from ()

    RECOMPUTED_TOKENS = 8192  # tokens per pass of a tree's recomputed paths (rows x their length)

    @torch.inference_mode()
    def tree_pass(self, tree, hit=None) -> torch.Tensor:
        """[R, V] raw log probabilities after each frontier node's path of a token tree (the prompt's end
        for the first pass), each path run whole through transformers' forward, rows batched up to
        RECOMPUTED_TOKENS: the lean runner's numbers, more work (prompt + depth tokens per node), and no
        state kept between levels."""
        paths = [tree.prompt_ids + (tree.path(node) if node >= 0 else []) for node in tree.frontier]
        rows_per_pass = max(1, self.RECOMPUTED_TOKENS // len(paths[0]))
        out = []
        for start in range(0, len(paths), rows_per_pass):
            ids = torch.tensor(paths[start:start + rows_per_pass], dtype=torch.long, device=self.device)
            hidden = self.decoder(input_ids=ids, use_cache=False).last_hidden_state[:, -1]
            out.append(self.logprobs_of(hidden))
        return out[0] if len(out) == 1 else torch.cat(out)

    def prefill_chunk(self, group: SequenceGroup, budget: int) -> torch.Tensor | None:
        """Advance the group's prefill; the log probabilities of its first token ([1, V]) when the
        prompt is done, else None. This runner does the whole prompt at once."""
        return self.prefill(group)

    def prefill_chunks(self, chunks: list[tuple[SequenceGroup, int]]) -> list[torch.Tensor | None]:
        """`prefill_chunk` for each (group, budget); a runner may run them in one pass."""
        return [self.prefill_chunk(group, budget) for group, budget in chunks]

    def cache_stats(self) -> dict:
        """This runner keeps a cache per request (not counted) and no prefix cache (the lean runner's)."""
        return {"kv_cache_bytes": 0, "prefix_cache_bytes": 0, "prefix_cache_hits": 0, "prefix_cache_misses": 0,
                "prefix_cache_tokens_saved": 0}

    def on_idle(self) -> None:
        """Called when the engine has nothing to do."""

    def start_prompt(self, group: SequenceGroup, hit=None, held: int = 0) -> None:
        """Nothing to take: this runner keeps no prefix cache (the engine gives its scheduler none, so
        nothing is ever held) and prefills a prompt in one go."""

    def cached_tokens(self, group: SequenceGroup) -> int:
        """0: this runner computes every prompt token (it keeps no prefix cache)."""
        return 0

    def decode_groups(self, groups: list[SequenceGroup]) -> list[torch.Tensor]:
        """One decode step for every active row of these groups: [rows, V] per group."""
        return [self.decode(g, [g.sequences[i].token_ids[-1] for i in g.active_rows]) for g in groups]

    def decode_with_prefill(self, groups: list[SequenceGroup], chunks: list[tuple[SequenceGroup, int]]) -> None:
        """None: this runner's decode and prompts run apart (a cache per request)."""
        return None

    def decode_and_pick(self, groups: list[SequenceGroup], k: int) -> tuple[list[torch.Tensor], np.ndarray | None]:
        """`decode_groups`, and where the runner can pick the rows' tokens in the same recorded pass (a
        CUDA graph on the lean runner), what the engine would bring to the host for them (sampler.pick's
        array, rows in the groups' order, their rows in order within each); None where it cannot: the
        engine picks them itself."""
        return self.decode_groups(groups), None

    def expand(self, group: SequenceGroup, rows: list, ops: list) -> None:
        """The group's cache repeated for each of its `rows` (the KV cache manager's operations are for a
        shared cache: this runner keeps one per request, and has none to carry out)."""
        if len(rows) > 1:
            self.caches[group].batch_repeat_interleave(len(rows))

    def select(self, group: SequenceGroup, keep: list[int], ops: list) -> None:
        self.caches[group].batch_select_indices(torch.tensor(keep, dtype=torch.long))

    def move(self, ops: list) -> None:
        """Nothing to move: a cache per request, no shared one (the manager's bookkeeping is kept all the same)."""

    def prompt_columns(self, group: SequenceGroup) -> PromptColumns | None:
        return self.columns_of.pop(group, None)

    def release(self, group, ops: list = ()) -> None:
        self.caches.pop(group, None)
        self.columns_of.pop(group, None)

    def reset(self) -> None:
        """Drop every request's cache after a failed step (the engine has failed every group holding one)."""
        self.caches.clear()
        self.columns_of.clear()

    def is_consistent(self, running: list[SequenceGroup]) -> bool:
        return all(g in self.caches for g in running)
