"""/v1/score's fields beyond a text: a conversation (`messages`, `score_messages`, `replies`) and asked token
ids, one list for every position or one per position (`logprob_token_ids`). Checked here without the model;
what needs its tokenizer (where a reply's tokens are, how many positions an entry has) is checked in
api/score/conversation.py and api/score/position_ids.py."""

from __future__ import annotations

from ...config import Limits
from ..checks import validation as v
from ..checks.prompts import all_ints
from ..errors import InvalidRequest


def parse_indices(value, limits: Limits) -> list[int] | None:
    """score_messages: a non-empty array of message indices, each once."""
    name = "score_messages"
    if value is None:
        return None
    if not isinstance(value, list) or not all_ints(value):
        raise v.type_error(name, "an array of message indices")
    if not value:
        raise v.value_error(name, "a non-empty array of message indices")
    if len(set(value)) != len(value):
        raise InvalidRequest("Invalid value for 'score_messages': each message index once.", name)
    return list(value)


def parse_replies(value, limits: Limits) -> list[str] | None:
    """replies: candidate contents of the conversation's next assistant turn, 1 to max_prompts of them."""
    name = "replies"
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(r, str) for r in value):
        raise v.type_error(name, "an array of strings")
    if not value:
        raise v.value_error(name, "a non-empty array of replies")
    if len(value) > limits.max_prompts:
        raise InvalidRequest(f"Too many replies: this server takes at most {limits.max_prompts} in one request "
                             f"(max_prompts), and this one has {len(value)}.", name)
    return list(value)


def parse_asked_ids(value, limits: Limits) -> tuple[int, ...] | list[list[tuple[int, ...]]]:
    """logprob_token_ids: an array of ids (the same ids at every scored position: a tuple), or one array of
    ids per scored position (one entry: [[...]]) or per entry and position ([[[...]]]): a list per entry of
    tuples per position. The caps: max_logprob_token_ids at one position, max_position_token_ids in all."""
    name = "logprob_token_ids"
    if value is None:
        return ()
    if not isinstance(value, list):
        raise v.type_error(name, "an array of token ids, or one array of token ids per position")
    if all_ints(value):
        lists = [[value]]
    elif all(isinstance(p, list) and all_ints(p) for p in value):
        lists = [value]
    elif all(isinstance(e, list) and all(isinstance(p, list) and all_ints(p) for p in e) for e in value):
        lists = value
    else:
        raise v.type_error(name, "an array of token ids, or one array of token ids per position")
    widest = max((len(p) for e in lists for p in e), default=0)
    if widest > limits.max_logprob_token_ids:
        raise InvalidRequest(f"Too many token ids in 'logprob_token_ids': this server takes at most "
                             f"{limits.max_logprob_token_ids} at one position (max_logprob_token_ids), and this "
                             f"request has {widest}.", name)
    if all_ints(value):
        return tuple(value)
    total = sum(len(p) for e in lists for p in e)
    if total > limits.max_position_token_ids:
        raise InvalidRequest(f"Too many token ids in 'logprob_token_ids': this server takes at most "
                             f"{limits.max_position_token_ids} in one request, summed over positions and entries "
                             f"(max_position_token_ids), and this request has {total}.", name)
    return [[tuple(p) for p in e] for e in lists]


def check_conversation(body, limits: Limits) -> None:
    """The rules between `messages`, `conversations`, `score_messages`, `replies` and the text fields."""
    if body.conversations is not None:
        for field in ("input", "context", "messages", "score_messages", "replies", "response_format",
                      "structured_outputs"):
            if getattr(body, field) is not None:
                raise InvalidRequest(f"'{field}' and 'conversations' cannot be combined: 'conversations' scores "
                                     "each conversation's last assistant turn (send one conversation in 'messages' "
                                     "for the other fields).", field)
        for c, messages in enumerate(body.conversations):
            if not any(m["role"] == "assistant" for m in messages):
                raise InvalidRequest(f"'conversations[{c}]' has no assistant message to score: end it with the "
                                     "assistant's reply.", "conversations")
        return
    if body.messages is None:
        for field in ("score_messages", "replies"):
            if getattr(body, field) is not None:
                raise InvalidRequest(f"'{field}' needs 'messages', the conversation it refers to.", field)
        if body.input is None:
            raise InvalidRequest("Missing required parameter: 'input'.", "input")
        return
    for field in ("input", "context"):
        if getattr(body, field) is not None:
            raise InvalidRequest(f"'{field}' and 'messages' cannot be combined: send a text in 'input' or a "
                                 "conversation in 'messages'.", field)
    for field in ("response_format", "structured_outputs"):
        if getattr(body, field) is not None:
            raise InvalidRequest(f"'{field}' is not offered with 'messages': score a conversation without a "
                                 "constraint.", field)
    if body.replies is not None:
        if body.score_messages is not None:
            raise InvalidRequest("'score_messages' and 'replies' cannot be combined: the replies are the turns "
                                 "scored.", "score_messages")
        return
    messages = body.messages
    for i in body.score_messages or []:
        if not 0 <= i < len(messages):
            raise InvalidRequest(f"Invalid value for 'score_messages': {i} is not a message index (the "
                                 f"conversation has messages 0 to {len(messages) - 1}).", "score_messages")
        if messages[i]["role"] != "assistant":
            raise InvalidRequest(f"Invalid value for 'score_messages': messages[{i}] is a {messages[i]['role']} "
                                 "message, not an assistant turn.", "score_messages")
    if body.score_messages is None and not any(m["role"] == "assistant" for m in messages):
        raise InvalidRequest("'messages' has no assistant message to score: end the conversation with the "
                             "assistant's reply, or send the candidate replies in 'replies'.", "messages")


def last_assistant(messages: list[dict]) -> int:
    return max(i for i, m in enumerate(messages) if m["role"] == "assistant")


def scored_turns(body) -> list[int]:
    """The indices, in the conversation the template renders, of the assistant turns scored: one entry each
    (with `conversations`, each conversation's last assistant turn)."""
    if body.conversations is not None:
        return [last_assistant(messages) for messages in body.conversations]
    if body.replies is not None:
        return [len(body.messages)] * len(body.replies)
    if body.score_messages is not None:
        return list(body.score_messages)
    return [last_assistant(body.messages)]


def check_entry_lists(body, num_entries: int) -> None:
    """Per-position ids come as one list of positions per entry."""
    ids = body.logprob_token_ids
    if isinstance(ids, list) and len(ids) != num_entries:
        raise InvalidRequest(f"Invalid value for 'logprob_token_ids': {len(ids)} lists of positions for "
                             f"{num_entries} scored entries; send one list of positions per entry (an array of "
                             "position arrays for each input, reply or scored message).", "logprob_token_ids")
