"""/v1/score on a conversation: `messages` rendered by the model's chat template as /v1/chat/completions
renders them, and only the tokens of the assistant turns named scored (docs/api.md, section 5.3).

The whole conversation is rendered and tokenized once, as chat does (the template writes the special
tokens). A turn's reply is found by text, then by token: the conversation before it, rendered with the
generation prompt (what chat would send the model before that reply), must be where the full rendering
begins, and the reply's content must follow; its first character must begin a token and its last end one
(each token's offset in the rendered text, from the token table's bytes). A template whose tokens merge
the reply with the text around it is refused rather than guessed. The template's end-of-turn token after
the content is scored too (`include_end_of_turn`), when it is one of the model's stop tokens.

An entry's prompt is the rendering up to the end of its scored turn, so the turns of one conversation and
the replies to it begin with the same tokens, and the engine runs that common prefix once for all of
them (engine/runners/lean/prompt_batch.py: a shared prefix, or the prefix cache).
"""

from __future__ import annotations

from ...tokens import TextAssembler
from ..checks.caps import check_text_length
from ..checks.messages import render
from ..errors import InvalidRequest
from .items import ScoreItem


def conversations(req) -> list[tuple[list[dict], int]]:
    """(the conversation rendered, the index of the turn scored in it) for each entry."""
    if req.conversations is not None:
        return list(zip(req.conversations, req.scored_turns))
    if req.replies is not None:
        return [(req.messages + [{"role": "assistant", "content": r}], len(req.messages)) for r in req.replies]
    return [(req.messages, i) for i in req.scored_turns]


class Rendered:
    """One conversation rendered and tokenized, with each token's character offset in the rendering;
    refusals name the conversation as `name` (`messages`, or `conversations[2]`) with `param`."""

    def __init__(self, backend, messages: list[dict], name: str = "messages", param: str = "messages"):
        self.name, self.param = name, param
        self.text = render(backend, messages, False, param=param)
        self.ids = backend.tokenizer(self.text, add_special_tokens=False).input_ids
        asm = TextAssembler(backend.table)
        for t in self.ids:
            asm.add(t, special_text=True)
        asm.finish()
        if asm.text != self.text:
            raise InvalidRequest(f"The model's tokens do not spell the rendered conversation ({name}) again, so the "
                                 "reply's tokens cannot be located; score the rendered text with 'input' instead.",
                                 param)
        self.start_of = {offset: i for i, offset in reversed(list(enumerate(asm.offsets)))}  # first token there

    def token_at(self, offset: int, what: str, index: int) -> int:
        """The index of the token that begins at character `offset` (len(ids) at the end of the text)."""
        if offset == len(self.text):
            return len(self.ids)
        if offset not in self.start_of:
            raise InvalidRequest(f"The chat template's tokens run across the {what} of {self.name}[{index}]'s "
                                 "content (a token holds text on both sides), so its tokens cannot be scored "
                                 "alone; change the content's first or last characters, or score the rendered "
                                 "text with 'input'.", self.param)
        return self.start_of[offset]


def tokenize(backend, req) -> list[ScoreItem]:
    """One ScoreItem per scored turn (api/score/serving.py): its conversation's tokens up to the turn's end, and
    where the turn's tokens begin."""
    several = req.conversations is not None
    param = "conversations" if several else "messages"
    if not backend.info.has_chat_template:
        raise InvalidRequest(f"This model has no chat template, so /v1/score cannot render '{param}'. Score the "
                             "text with 'input', or start the server with --chat-template FILE (a Jinja "
                             "template).", param)
    if several:
        check_text_length(backend, [m["content"] for c in req.conversations for m in c], param)
    else:
        check_text_length(backend, [m["content"] for m in req.messages] + list(req.replies or []), param)
    items, renderings = [], {}
    for k, (messages, index) in enumerate(conversations(req)):
        name = f"conversations[{k}]" if several else "messages"
        key = id(messages)
        if key not in renderings:
            renderings[key] = Rendered(backend, messages, name, param)
        full = renderings[key]
        before = render(backend, messages[:index], True, param=param)
        content = messages[index]["content"]
        if not full.text.startswith(before) or full.text.find(content, len(before)) != len(before):
            raise InvalidRequest(f"The model's chat template does not render {name}[{index}] as a reply after "
                                 "the conversation before it (as /v1/chat/completions would prompt for it), so "
                                 "its tokens cannot be located.", param)
        first = full.token_at(len(before), "start", index)
        stop = full.token_at(len(before) + len(content), "end", index)
        if req.include_end_of_turn and stop < len(full.ids) and full.ids[stop] in backend.info.stop_token_ids:
            stop += 1
        if stop == first:
            raise InvalidRequest(f"Invalid value for '{param}': {name}[{index}] has no tokens to score.", param)
        items.append(ScoreItem(list(full.ids[:stop]), first, content, message_index=index))
    return items
