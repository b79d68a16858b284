"""A `choice` list decided before generation (api/serving/choice_decision.py): each sequence spells the tokens
of the answer drawn for it, then ends.

The API scores every answer after the prompt, draws one per sequence, and hands the engine a
`Constraint("chosen", ...)`: the answers, their tokens and log probabilities, and which answer each
sequence (by its index) spells. Each sequence's state is then a `ForcedTokens`: the allowed set at each
position is the drawn answer's next token, and once it is spelled the stop tokens. It has what the
engine asks of a `GrammarState` (`allowed`, `allowed_into`, `sets`, `advance`, `is_accepting`). No torch, no
llguidance here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from ...backend import Constraint


class TokenNotForced(ValueError):
    """`ForcedTokens.advance` was given a token other than the one the answer spells there."""


@dataclass(frozen=True)
class ChoiceDecision:
    """Every answer of a `choice` list after one prompt, and the answer each sequence spells."""

    texts: tuple[str, ...]
    token_ids: tuple[tuple[int, ...], ...]  # each answer's tokens, as read after the prompt
    logprobs: tuple[float, ...]  # each answer's log probability: its tokens' summed
    picks: tuple[int, ...]  # per sequence index: the index of the answer it spells
    scored_tokens: int = 0  # the tokens of the scoring passes that decided it: (prompt + answer) per answer

    def constraint(self) -> Constraint:
        return Constraint("chosen", json.dumps({"texts": self.texts, "token_ids": self.token_ids,
                                                "logprobs": self.logprobs, "picks": self.picks,
                                                "scored_tokens": self.scored_tokens}, ensure_ascii=False))

    @classmethod
    def of(cls, constraint: Constraint) -> ChoiceDecision:
        data = json.loads(constraint.source)
        return cls(tuple(data["texts"]), tuple(tuple(ids) for ids in data["token_ids"]), tuple(data["logprobs"]),
                   tuple(data["picks"]), int(data.get("scored_tokens", 0)))


def sequence_constraint(constraint: Constraint, index: int) -> Constraint:
    """What sequence `index` of a request under `constraint` follows: for a decided choice, the tokens
    of its own answer (kind "tokens"); any other constraint as it is."""
    if constraint.kind != "chosen":
        return constraint
    decision = ChoiceDecision.of(constraint)
    return Constraint("tokens", json.dumps(decision.token_ids[decision.picks[index]]))


class ForcedTokens:
    """A sequence that must spell `tokens`, then end with one of `stop_ids`."""

    def __init__(self, tokens, vocab_size: int, stop_ids):
        self.tokens = [int(t) for t in tokens]
        self.vocab_size = vocab_size
        self.stop_ids = list(stop_ids)
        self.at = 0  # tokens spelled so far

    def allowed(self) -> np.ndarray:
        out = np.zeros(self.vocab_size, dtype=bool)
        self.allowed_into(out)
        return out

    def allowed_into(self, out: np.ndarray) -> None:
        out[:] = False
        if self.at < len(self.tokens):
            out[self.tokens[self.at]] = True
        else:
            out[self.stop_ids] = True

    def sets(self) -> tuple[np.ndarray, None]:
        return self.allowed(), None

    def advance(self, token: int) -> None:
        token = int(token)
        if self.at < len(self.tokens) and token == self.tokens[self.at]:
            self.at += 1
        elif not (self.is_accepting and token in self.stop_ids):
            raise TokenNotForced(f"token {token} is not the answer's next token")

    @property
    def is_accepting(self) -> bool:
        return self.at == len(self.tokens)

    @property
    def is_finished(self) -> bool:
        return self.is_accepting
