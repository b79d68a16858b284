"""What /v1/score runs for each of its entries: one text, conversation turn or list of ids as the model's
tokens, written by serving.py (texts, ids) and conversation.py (turns)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ScoreItem:
    token_ids: list[int]  # what the model runs: [BOS] + context + input
    first: int  # index of the input's first token in token_ids
    text: str | None  # the input text (None for token ids)
    constraint_check: object = None  # grammar.TextCheck of the input's tokens, under req.constraint
    message_index: int | None = None  # the conversation's turn scored (conversation.py)
