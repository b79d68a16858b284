"""Steering: what, beyond temperature, top-k and top-p, shapes the distribution a token is drawn from
(docs/api.md, section 2.5): `logit_bias` added to the raw log probabilities, and a mask of the tokens
that may be drawn (`allowed_token_ids`, `bad_words`, a grammar's allowed set).

Two distributions come out of one step of a steered row, both from the same raw rows ([R, V], the model's
log_softmax in float32):

    raw        the model's distribution, untouched: what `logprobs_mode: raw` reports
    processed  log_softmax(filtered((raw + bias) masked to the allowed tokens)), the filters being the
               temperature, top-k and top-p of sampler.filtered_scores: what the token is drawn from
               and what `logprobs_mode: processed` reports (a greedy row: a point mass, as unsteered)

and, where a mask is in force, `constraint_logprob = logsumexp(raw[allowed])`: how much of the model's
probability the mask kept (exactly 0 at a position where it allowed every token). Where a grammar forces
a text, the draw's mask holds the tokenizer's spelling of it alone while `allowed` holds every spelling
the grammar accepts (`steering_of`).

Only steered requests come here (instruments.pick_with_instruments picks their rows on their own), so
a plain row is drawn by sampler.pick exactly as when no steered request runs beside it.
"""

from __future__ import annotations

import numpy as np
import torch

from ...backend import RequestConflict, SamplingParams
from .sampler import BatchSettings, filtered_scores, to_device


class NoAllowedToken(RequestConflict):
    """Every token of the vocabulary is masked at a position (allowed_token_ids, bad_words, the grammar
    and min_tokens leave nothing): nothing can be drawn, so the request cannot go on. The request's own
    fields disagree: a 400 naming them (docs/api.md, 2.5), never an engine failure."""


def conflict_at(params: SamplingParams, num_generated: int) -> NoAllowedToken:
    """The error of a request whose masks leave no token for its token `num_generated` + 1, naming the
    fields in force there as the request's body names them."""
    fields = [params.constraint.param] if params.constraint is not None else []
    fields += ["allowed_token_ids"] if params.allowed_token_ids is not None else []
    fields += ["bad_words"] if params.bad_words_ids else []
    fields += ["min_tokens"] if num_generated < params.min_tokens else []
    quoted = [f"'{f}'" for f in fields] or ["the request's steering"]
    named = f"{quoted[0]} allows" if len(quoted) == 1 else f"{', '.join(quoted[:-1])} and {quoted[-1]} together allow"
    return NoAllowedToken(
        f"Invalid request: {named} no token at generated token {num_generated + 1}, so nothing can be generated "
        "there. Change them so that some token satisfies all of them at every step.", fields[0] if fields else None)


class Steering:
    """One request's steering, built once on the engine's side: the bias as a device vector, the mask
    that holds at every position (allowed_token_ids less the one-token bad words), and the bad words of
    several tokens, whose last token is masked where the tokens before it were just generated."""

    def __init__(self, params: SamplingParams, vocab: int, device):
        self.vocab = vocab
        self.bias: torch.Tensor | None = None  # [V] float32
        if params.logit_bias:
            ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
            values = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)
            self.bias = torch.zeros(vocab, dtype=torch.float32).index_put_((ids,), values).to(device)
        allowed = None
        if params.allowed_token_ids is not None:
            allowed = np.zeros(vocab, dtype=bool)
            allowed[list(params.allowed_token_ids)] = True
        singles = [w[0] for w in params.bad_words_ids if len(w) == 1]
        if singles:
            allowed = np.ones(vocab, dtype=bool) if allowed is None else allowed
            allowed[singles] = False
        self.static_allowed = allowed  # [V] bool or None
        self.sequences = [tuple(w) for w in params.bad_words_ids if len(w) > 1]
        self.stop_ids = [t for t in params.stop_token_ids if 0 <= t < vocab]
        self.params = params

    def row_mask(self, token_ids: list[int], grammar_allowed: np.ndarray | None = None,
                 grammar_accepting: bool = False) -> np.ndarray | None:
        """[V] bool: the tokens a sequence that generated `token_ids` may draw next (None: every one).
        A grammar that is complete and allows nothing but the end (or nothing at all) allows the stop
        tokens alone: the choice then ends with "stop". Before `min_tokens` tokens, no stop token (vLLM)."""
        blocked = [w[-1] for w in self.sequences
                   if len(token_ids) >= len(w) - 1 and tuple(token_ids[len(token_ids) - len(w) + 1:]) == w[:-1]]
        if len(token_ids) < self.params.min_tokens:
            blocked += self.stop_ids
        if grammar_allowed is None and not blocked:
            return self.static_allowed
        mask = np.ones(self.vocab, dtype=bool) if self.static_allowed is None else self.static_allowed.copy()
        if blocked:
            mask[blocked] = False
        if grammar_allowed is not None:
            grammar = np.zeros(self.vocab, dtype=bool)
            width = min(self.vocab, len(grammar_allowed))
            grammar[:width] = grammar_allowed[:width]
            if grammar_accepting and self.stop_ids:
                others = grammar.copy()
                others[self.stop_ids] = False
                if not others.any():  # complete, and only the end may follow: end here
                    grammar[:] = False
                    grammar[self.stop_ids] = True
            mask &= grammar
        return mask

    def masks(self, rows_token_ids: list[list[int]], grammar: list[tuple[np.ndarray, bool]] | None = None,
              allow_empty: bool = False) -> np.ndarray | None:
        """[R, V] bool for rows of sequences (their generated tokens, and each one's grammar mask and
        whether its grammar is complete), or None when no row masks anything. A row that allows no
        token raises the conflict (unless `allow_empty`)."""
        rows = [self.row_mask(ids, *(grammar[r] if grammar is not None else (None, False)))
                for r, ids in enumerate(rows_token_ids)]
        if all(m is None for m in rows):
            return None
        out = np.stack([np.ones(self.vocab, dtype=bool) if m is None else m for m in rows])
        empty = ~out.any(axis=1)
        if empty.any() and not allow_empty:
            raise conflict_at(self.params, len(rows_token_ids[int(np.flatnonzero(empty)[0])]))
        return out

    def scores(self, raw_rows: torch.Tensor, masks: np.ndarray | torch.Tensor | None) -> torch.Tensor:
        """[R, V] float32: raw + bias, -inf where the mask says no: what the sampler's filters and draw
        take in place of the raw rows (a constant per row changes neither)."""
        scores = raw_rows if self.bias is None else raw_rows + self.bias
        if masks is not None:
            scores = scores.masked_fill(~on_device(masks, raw_rows.device), float("-inf"))
        return scores


def on_device(masks: np.ndarray | torch.Tensor, device) -> torch.Tensor:
    """[R, V] bool masks on the device (a host array is copied without waiting for the device)."""
    return masks if isinstance(masks, torch.Tensor) else to_device(masks, torch.bool, device)


def steering_of(group, logprob_rows: torch.Tensor
                ) -> tuple[Steering | None, np.ndarray | None, np.ndarray | None]:
    """(a SequenceGroup's Steering, built at its first pick, the masks [R, V] bool of the tokens its active
    rows may draw, and the masks of the tokens the allowed mass counts), from the grammar sets taken for
    this step; (None, None, None) for an unsteered group. The two masks differ only where a grammar forces
    a text (host/grammar.py `GrammarState.sets`): a row draws the tokenizer's spelling of it, or, where
    `allowed_token_ids` or a bad word rules that out, any token that keeps the text inside."""
    if not group.params.is_steered:
        return None, None, None
    if group.steering is None:
        group.steering = Steering(group.params, logprob_rows.shape[-1], logprob_rows.device)
    grammar, group.grammar_masks = group.grammar_masks, None
    rows = [group.sequences[i].token_ids for i in group.active_rows]
    kept = group.steering.masks(rows, None if grammar is None else [(a, complete) for a, complete, _ in grammar])
    if grammar is None or all(drawn is None for _, _, drawn in grammar):
        return group.steering, kept, kept
    drawn = group.steering.masks(rows, [(a if d is None else d, complete) for a, complete, d in grammar],
                                 allow_empty=True)
    empty = ~drawn.any(axis=1)
    drawn[empty] = kept[empty]
    return group.steering, drawn, kept


def grammar_rows(group) -> list[tuple[np.ndarray, bool, np.ndarray | None]]:
    """(allowed [V] bool, complete, the tokens that may be drawn where fewer [V] bool or None) of the
    grammar of each active row of a constrained group (SequenceGroup): run on the grammar thread while
    the forward pass runs (core.py)."""
    rows = []
    for seq in (group.sequences[i] for i in group.active_rows):
        allowed, drawn = seq.grammar.sets()
        rows.append((allowed, seq.grammar.is_accepting, drawn))
    return rows


def allowed_logmass(raw_rows: torch.Tensor, masks: np.ndarray | torch.Tensor | None) -> torch.Tensor:
    """[R] float32: log of the raw probability mass of each row's allowed tokens; exactly 0 for a row
    whose mask allows every token (or for every row when there is no mask), and never above 0 (float32
    log probabilities can sum to a little over 1: a mask that leaves out only negligible tokens)."""
    if masks is None:
        return raw_rows.new_zeros(raw_rows.shape[0])
    allowed = on_device(masks, raw_rows.device)
    mass = torch.logsumexp(raw_rows.masked_fill(~allowed, float("-inf")), dim=-1).clamp_max(0.0)
    return torch.where(allowed.all(dim=-1), torch.zeros_like(mass), mass)


def distribution_of(scores: torch.Tensor, settings: BatchSettings) -> torch.Tensor:
    """[R, V] float32 log probabilities of the distribution each row is drawn from (sampler.sample_with_
    distribution's, without the draw): a point mass on the largest score for a greedy row."""
    point = torch.full_like(scores, float("-inf")).scatter_(-1, torch.argmax(scores, dim=-1)[:, None], 0.0)
    if settings.all_greedy:
        return point
    processed = torch.log_softmax(filtered_scores(scores, settings), dim=-1)
    return torch.where(settings.greedy[:, None], point, processed)


def steered_distributions(raw_rows: torch.Tensor, params: SamplingParams, masks: np.ndarray | None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows of raw log probabilities ([R, V] float32) under one request's parameters: (the processed
    distributions [R, V], the allowed log mass [R]). `masks` ([R, V] bool, None: none) are the rows'
    masks beyond what the parameters say at every position (a grammar's allowed sets, bad words of
    several tokens); the request's `allowed_token_ids` and one-token bad words are added here. The
    helper the token tree and scoring under a constraint share with generation."""
    num_rows, vocab = raw_rows.shape
    steering = Steering(params, vocab, raw_rows.device)
    static = steering.static_allowed
    if static is not None:
        masks = np.broadcast_to(static, (num_rows, vocab)).copy() if masks is None else masks & static
    settings = BatchSettings.of([params] * num_rows, vocab, raw_rows.device, [0] * num_rows)
    return distribution_of(steering.scores(raw_rows, masks), settings), allowed_logmass(raw_rows, masks)
