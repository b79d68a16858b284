"""A conversation: the messages every route that takes one shares (chat, /v1/score, /v1/tree, /tokenize,
the Responses API), their checks, and their rendering by the model's chat template."""

from __future__ import annotations

from typing import Literal

from ..errors import InvalidRequest
from .schema import RequestModel

ROLES = ("system", "user", "assistant")


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class Message(RequestModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


def message_list(value, name: str = "messages", param: str = "messages") -> list[dict]:
    """A conversation's messages as {"role", "content"}, text parts joined; refusals name `name` (the
    field, or `conversations[2]`) and carry `param`."""
    if value is None:
        raise InvalidRequest(f"Missing required parameter: '{name}'.", param)
    if not isinstance(value, list) or not value:
        raise InvalidRequest(f"Invalid value for '{name}': expected a non-empty array of messages.", param)
    out = []
    for i, msg in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(msg, dict):
            raise InvalidRequest(f"Invalid type for '{where}': expected an object.", param)
        role, content = msg.get("role"), msg.get("content")
        if role not in ROLES:
            raise InvalidRequest(f"Invalid value for '{where}.role': expected one of {', '.join(ROLES)}.",
                                 param)
        extra = set(msg) - set(Message.model_fields)
        if extra:
            raise InvalidRequest(f"Unrecognized request argument supplied: {where}.{sorted(extra)[0]}",
                                 param)
        if isinstance(content, list):  # OpenAI content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise InvalidRequest(f"Invalid value for '{where}.content': only text parts are supported.",
                                     param)
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise InvalidRequest(f"Invalid type for '{where}.content': expected a string.", param)
        out.append({"role": role, "content": content})
    return out


def render(backend, messages: list[dict], add_generation_prompt: bool = True, param: str = "messages") -> str:
    """The conversation as the model's chat template writes it (the prompt chat runs, and /v1/score's
    conversations: score/conversation.py); a template that fails is the 400 of `param`."""
    try:
        return backend.tokenizer.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # a template that raises on these messages (e.g. a role it forbids)
        raise InvalidRequest(f"The model's chat template could not render these messages: "
                             f"{str(exc)[:200]}", param) from None


def rendered_ids(backend, messages: list[dict], add_generation_prompt: bool = True, add_special_tokens: bool = False,
                 param: str = "messages") -> tuple[str, list[int]]:
    """(the chat template's rendering, its token ids): the template writes the special tokens, so the
    tokenizer adds none of its own unless asked (/tokenize's `add_special_tokens`)."""
    if not backend.info.has_chat_template:
        raise InvalidRequest("This model has no chat template, so a conversation cannot become a prompt. "
                             "Use /v1/completions with your own prompt, or start the server with "
                             "--chat-template FILE (a Jinja template).", param)
    text = render(backend, messages, add_generation_prompt=add_generation_prompt, param=param)
    return text, backend.tokenizer(text, add_special_tokens=add_special_tokens).input_ids
