"""Prompt-only groups (scoring, echo with max_tokens 0) on the lean runner: one right-padded pass, no KV
cache kept for decoding, and prompts' first tokens run once where they can be shared.

A prompt's first tokens can skip the blocks two ways (`PromptBatches.run_shared` then runs the batch):
prompts of the batch that begin with the same tokens (one context, several continuations: a
multiple-choice question) share that prefix's pass, and a prompt that begins with a prefix kept in the
prefix cache (prefix_cache.py) from an earlier batch attends to its keys and values (lm-evaluation-harness
sorts requests by length, so the answers of one question mostly come in different batches). A prompt
uses the batch's shared prefix where it is longer than its kept one, else the kept one (a header every
question begins with, kept, must not undo the sharing of a question's whole context within the batch).
After the pass, each shared prefix and each prompt's own whole blocks go into the cache (`Seeds`).
"""

from __future__ import annotations

from typing import Generator, Iterator

import numpy as np
import torch

from ..interventions import segment_editor
from ...host.prefix_index import BLOCK, prompt_hits, uses_prefix_cache
from ..prefix_cache import views
from ..prompt_columns import copy_rows
from ...host.request import PromptColumns, SequenceGroup
from .attention import PassMeta, PrefixedKV


class PromptBatches:
    """The prompt-only passes of a `LeanRunner`."""

    SHARED_PREFIX_MIN = 16  # prompt-only prompts sharing at least this many first tokens share their pass
    # A batch of unlike lengths runs as several passes of like lengths: every padded position costs as
    # much as a real one in the blocks. A pass is cut off where padding would pass MAX_PADDING of its
    # tokens and PASS_COST_TOKENS, about what one more pass costs (its fixed work: 30 blocks of small
    # products, the masks), in tokens' worth.
    MAX_PADDING = 0.15
    PASS_COST_TOKENS = 128

    def __init__(self, runner):
        self.runner = runner

    def steps(self, groups: list[SequenceGroup], found: list | None = None,
              head_positions: int | None = None) -> Iterator[int]:
        """Fill each group's prompt columns (where it asks for them) from right-padded passes of like
        lengths (or `run_shared`'s, where prompts share a prefix), as steps (LeanRunner.prompt_pass):
        yields after each block and before each head run of `head_positions` at most. The plain causal
        mask is enough: padding sits after each prompt, so a real position never sees it (padded
        positions' outputs are dropped). `found`: each group's prefix-cache hit, as the engine found it
        (None: found here)."""
        # A group with interventions runs a modified forward pass: its keys and values are not those of
        # its tokens alone, so it neither uses nor seeds the prefix cache, nor shares a prefix in the batch.
        plain = [i for i, g in enumerate(groups) if uses_prefix_cache(g.params)]
        if found is None:
            found = prompt_hits(self.runner.prefix_cache, groups)
        hits = {i: views(found[i]) for i in plain if found[i] is not None}
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
        for i, (length, *_) in hits.items():  # its prompt attends to the kept prefix's keys: not computed
            if i not in taken:
                self.runner.record(groups[i]).cached = length
        if clusters:
            yield from self.run_shared(groups, clusters, head_positions)
            return
        for members in by_length([g.num_prompt_tokens for g in groups], self.MAX_PADDING, self.PASS_COST_TOKENS):
            yield from self.run_plain([groups[i] for i in members], head_positions)

    def run_plain(self, groups: list[SequenceGroup], head_positions: int | None) -> Iterator[int]:
        """One right-padded pass of whole prompts, each from position 0."""
        runner = self.runner
        plain = [i for i, g in enumerate(groups) if not g.params.interventions]
        lengths = [g.num_prompt_tokens for g in groups]
        longest = max(lengths)
        ids = torch.zeros((len(groups), longest), dtype=torch.long)
        for row, g in enumerate(groups):
            ids[row, :lengths[row]] = torch.tensor(g.prompt_ids, dtype=torch.long)
        ids = ids.to(runner.device)
        firsts = [0] * len(groups)
        seeds = Seeds(self, groups, plain, firsts, {}, {})
        masks, read = runner.attention.own_pass(longest)
        meta = PassMeta(torch.arange(longest, device=runner.device)[None].expand(len(groups), -1), masks, read=read,
                        keep=seeds.keep if seeds else None)
        edit = segment_editor([(row, 0, lengths[row], g.edits) for row, g in enumerate(groups)])
        hidden = yield from runner.forward_steps(ids, meta, edit=edit)
        yield from self.fill_columns(groups, hidden, ids, lengths, head_positions)
        seeds.insert(hidden)

    def fill_columns(self, groups: list[SequenceGroup], hidden: torch.Tensor, ids: torch.Tensor,
                     lengths: list[int], head_positions: int | None) -> Iterator[int]:
        """Each group's prompt columns from a pass's hidden states [B, T, D] and ids [B, T]. Prompts
        whose columns have the same shape go through the head together: the positions that predict a
        token, of all of them, in one run of `columns.fill`, then cut per prompt. A short prompt alone
        is a product of a few rows with the whole head (its every weight read for ~10 positions):
        measured per position, 8 rows cost ~6x and 20 rows ~3x what 256 rows do."""
        runner, by_shape = self.runner, {}
        for row, g in enumerate(groups):
            if g.params.needs_prompt_logits:
                by_shape.setdefault(column_shape(g.params), []).append(row)
        for rows in by_shape.values():
            params = groups[rows[0]].params
            # the whole vocabulary: bounded per prompt; ids per position: rows of each prompt's own
            if len(rows) == 1 or params.prompt_logprobs == -1 or params.position_token_ids:
                for row in rows:
                    n = lengths[row]
                    runner.record(groups[row]).columns = yield from runner.columns.whole_steps(
                        hidden[row, :n], ids[row, :n], params, head_positions)
                continue
            states = torch.cat([hidden[row, :lengths[row] - 1] for row in rows])  # each predicts the next token
            targets = torch.cat([ids[row, 1:lengths[row]] for row in rows])
            together = runner.columns.new(1 + states.shape[0], params)  # row 0: before the first target
            yield from runner.columns.fill_steps(together, states, torch.cat([targets[:1], targets]), 0, head_positions)
            start = 1
            for row in rows:
                cols = runner.columns.new(lengths[row], params)
                copy_shifted(together, start, cols, lengths[row] - 1)
                runner.record(groups[row]).columns = cols
                start += lengths[row] - 1

    def run_shared(self, groups: list[SequenceGroup], clusters: list[tuple], head_positions: int | None
                   ) -> Iterator[int]:
        """`clusters`: (length, members) for a prefix the members share within the batch, or (length,
        members, (keys, values, hidden)) for one kept in the prefix cache. Each shared prefix runs once
        (its keys, values and final hidden states kept); a kept one does not run at all. Then every
        prompt's own tokens run in one right-padded pass whose rows attend to their prefix's keys and
        values and to their own, at their true positions (a row without a prefix attends to its own
        only). Each group's columns come from its prefix's hidden states and its own, as from one pass
        (the prefix's rows through the head here, whether its blocks ran here or in an earlier batch)."""
        runner = self.runner
        prefix_of = {}  # group index -> (prefix length, keys per layer, values per layer, hidden [P, D])
        ran = []  # the batch's shared prefixes, for the prefix cache: (ids, keys, values, hidden)
        copies = {}  # group index -> tokens of its prefix an entry of its own blocks would hold twice
        for length, members, *kept in clusters:
            if kept:
                keys, values, hidden = kept[0]
                copies.update((m, length) for m in members
                              if runner.prefix_cache.branches(groups[m].prompt_ids, length))
            else:
                copies.update((m, length) for m in members)
                prefix = groups[members[0]].prompt_ids[:length]
                keys, values, hidden = yield from self.run_prefix(prefix)
                ran.append((prefix, keys, values, hidden))
            for m in members:
                prefix_of[m] = (length, keys, values, hidden)
        firsts = [prefix_of[i][0] if i in prefix_of else 0 for i in range(len(groups))]
        own = [g.num_prompt_tokens - first for g, first in zip(groups, firsts)]
        ids = torch.zeros((len(groups), max(own)), dtype=torch.long)
        for row, g in enumerate(groups):
            ids[row, :own[row]] = torch.tensor(g.prompt_ids[firsts[row]:], dtype=torch.long)
        seeds = Seeds(self, groups, [i for i, g in enumerate(groups) if not g.params.interventions], firsts, copies,
                      prefix_of)
        meta = self.prepare_prefixed(firsts, own, prefix_of)
        meta.keep = seeds.keep if seeds else None
        # rows with interventions have no prefix: their own tokens are the whole prompt, from position 0
        edit = segment_editor([(row, 0, own[row], g.edits) for row, g in enumerate(groups)])
        hidden = yield from runner.forward_steps(ids.to(runner.device), meta, edit=edit)
        done: list[tuple] = []  # (prefix hidden, params, columns with the prefix's rows filled)
        for row, g in enumerate(groups):
            if not g.params.needs_prompt_logits:
                continue
            full = torch.tensor(g.prompt_ids, dtype=torch.long, device=runner.device)
            mine = hidden[row, :own[row]]
            if row not in prefix_of:
                runner.record(g).columns = yield from runner.columns.whole_steps(mine, full, g.params, head_positions)
                continue
            # Rows 1..P-1 (the prefix's own tokens) are the same for every prompt of the prefix: reduced
            # once per prefix and settings, copied; rows P.. (predicted from the prefix's last state on)
            # are this prompt's own.
            length, _, _, prefix_hidden = prefix_of[row]
            cols = runner.columns.new(g.num_prompt_tokens, g.params)
            filled = next((c for h, p, c in done if h is prefix_hidden and p == g.params), None)
            if filled is None:
                yield from runner.columns.fill_steps(cols, prefix_hidden[:length - 1], full, 0, head_positions)
                done.append((prefix_hidden, g.params, cols))
            else:
                copy_rows(filled, cols, 1, length)
            yield from runner.columns.fill_steps(cols, torch.cat([prefix_hidden[length - 1:], mine]), full, length - 1,
                                                 head_positions)
            runner.record(g).columns = cols
        seeds.insert(hidden)
        for prefix, keys, values, prefix_hidden in ran:  # after the prompts' own blocks: a shared prefix
            runner.prefix_cache.insert(prefix, keys, values, prefix_hidden)  # one of them holds is not kept twice

    def run_prefix(self, prefix: list[int]) -> Generator[int, None, tuple[list, list, torch.Tensor]]:
        """A shared prefix's own pass: its keys and values per layer ([KV, P, d]) and hidden states [P, D]."""
        runner, length = self.runner, len(prefix)
        keys, values = [None] * len(runner.blocks), [None] * len(runner.blocks)

        def keep(layer, k, v):
            keys[layer], values[layer] = k[0], v[0]

        masks, read = runner.attention.own_pass(length)
        meta = PassMeta(torch.arange(length, device=runner.device)[None], masks, read=read, keep=keep)
        hidden = yield from runner.forward_steps(torch.tensor([prefix], dtype=torch.long).to(runner.device), meta)
        return keys, values, hidden[0]

    def prepare_prefixed(self, firsts: list[int], own: list[int], prefix_of: dict) -> PassMeta:
        """The pass of each row's own tokens after its prefix of firsts[row] positions: each row's keys at
        their positions (its prefix's, then its own), read to `Attention.aligned` of the longest row's
        end, so a row's keys sit where they would if it ran alone."""
        runner, device = self.runner, self.runner.device
        attention = runner.attention
        positions = torch.tensor(firsts, device=device)[:, None] + torch.arange(max(own), device=device)[None]
        read = attention.aligned(max(f + n for f, n in zip(firsts, own)))
        rows = np.repeat(np.arange(len(own)), own)
        sources = np.concatenate([np.arange(n) for n in own])
        index = tuple(torch.from_numpy(a).to(device) for a in (rows, sources, sources + np.asarray(firsts)[rows]))
        kv = PrefixedKV((len(own), runner.kv_heads, read, runner.head_dim), prefix_of, index)
        return PassMeta(positions, attention.prompt_masks(positions, read), kv=kv, read=read)


class Seeds:
    """The rows of a pass whose own whole blocks go into the prefix cache, their keys and values kept
    layer by layer during the pass (`keep`) and inserted after it (`insert`). A row of `plain` (no
    interventions) is one whose first m tokens (m: its length cut to whole blocks) add a block at least
    to its prefix (`firsts[row]`: from the batch or the cache, 0 for none), and no fewer tokens than they
    would hold a second time (`copies[row]`: its prefix, where the batch shares it or a kept entry goes
    on past it), that no entry holds already and no earlier row of the batch seeds.

    Entries do not share memory, so a branch off a kept prefix holds the prefix again: with every
    answer seeding its own blocks, benchmarks/multiple_choice.py's answers in separate batches left
    57 entries of 4.4 MB for 24 questions (252 MB) instead of 24, and a question's later answers seldom
    reach a block past where they part. An entry that only extends a kept one replaces it."""

    def __init__(self, batches: PromptBatches, groups: list[SequenceGroup], plain: list[int], firsts: list[int],
                 copies: dict[int, int], prefix_of: dict):
        cache, num_layers = batches.runner.prefix_cache, len(batches.runner.blocks)
        self.cache, self.groups, self.firsts, self.prefix_of = cache, groups, firsts, prefix_of
        self.rows: list[tuple] = []  # (row, m, keys per layer, values per layer)
        seen = set()
        if not cache.enabled:
            return
        for row in plain:
            ids = groups[row].prompt_ids
            m = len(ids) // BLOCK * BLOCK
            if (m - firsts[row] >= max(BLOCK, copies.get(row, 0)) and tuple(ids[:m]) not in seen
                    and not cache.covers(ids[:m])):
                seen.add(tuple(ids[:m]))
                self.rows.append((row, m, [None] * num_layers, [None] * num_layers))

    def __bool__(self) -> bool:
        return bool(self.rows)

    def keep(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy each seed row's keys and values of `layer` (k, v: [rows, KV, T, d] of the pass, after the
        row's prefix of firsts[row] positions) out of the batch: [KV, m, d], its prefix's in front."""
        for row, m, keys, values in self.rows:
            first = self.firsts[row]
            mine_k, mine_v = k[row, :, :m - first], v[row, :, :m - first]
            if first:
                _, prefix_k, prefix_v, _ = self.prefix_of[row]
                keys[layer] = torch.cat([prefix_k[layer][:, :first], mine_k], dim=1)
                values[layer] = torch.cat([prefix_v[layer][:, :first], mine_v], dim=1)
            else:
                keys[layer] = mine_k.clone(memory_format=torch.contiguous_format)
                values[layer] = mine_v.clone(memory_format=torch.contiguous_format)

    def insert(self, hidden: torch.Tensor) -> None:
        """Put the seed rows' keys, values and final-normed hidden states ([rows, T, D] of the pass, after
        each row's prefix) into the prefix cache."""
        for row, m, keys, values in self.rows:
            first = self.firsts[row]
            mine = hidden[row, :m - first]
            states = torch.cat([self.prefix_of[row][3][:first], mine]) if first else mine
            self.cache.insert(self.groups[row].prompt_ids[:m], keys, values, states)


def column_shape(params) -> tuple:
    """What a prompt's columns hold (PromptColumnWriter.new): prompts alike in this fill one set together."""
    return (params.num_prompt_top, params.prompt_logprobs == -1, tuple(params.logprob_token_ids),
            params.position_stats, params.top_logprobs_p, params.max_top_p_tokens, params.position_token_ids)


def copy_shifted(source: PromptColumns, start: int, target: PromptColumns, count: int) -> None:
    """Rows start..start+count-1 of `source`'s per-position arrays into rows 1..count of `target`."""
    for name in ("logprobs", "ranks", "top_ids", "top_logprobs"):
        getattr(target, name)[1:1 + count] = getattr(source, name)[start:start + count]
    if source.extras is not None:
        for name, array in vars(source.extras).items():
            if isinstance(array, np.ndarray) and name not in ("token_ids", "position_ids"):
                getattr(target.extras, name)[1:1 + count] = array[start:start + count]


def by_length(lengths: list[int], max_padding: float, pass_cost: int) -> list[list[int]]:
    """Indices of `lengths` in passes of like length, shortest first: a pass takes the next longer
    prompt unless its padding would then be more than `max_padding` of its padded tokens and more
    than `pass_cost` tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    passes, current, real = [], [], 0
    for i in order:
        padded = lengths[i] * (len(current) + 1)  # the pass's longest prompt would be this one
        waste = padded - real - lengths[i]
        if current and waste > max_padding * padded and waste > pass_cost:
            passes.append(current)
            current, real = [], 0
        current.append(i)
        real += lengths[i]
    if current:
        passes.append(current)
    return passes


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
