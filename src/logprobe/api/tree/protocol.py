"""The body of POST /v1/tree: a prompt (or chat messages) and the shape of the token tree below it."""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import ConfigDict, Field

from ...backend import TreeShape
from ...config import Limits
from ..checks import validation as v
from ..checks.constraints import ConstraintFields, ResponseFormatField, StructuredOutputsField
from ..checks.messages import Message, message_list
from ..checks.prompts import all_ints
from ..checks.sampling import (
    AllowedTokenIds,
    BadWords,
    LogitBias,
    SamplingFields,
    Temperature,
    TokensAsIds,
    TopK,
    TopP,
    User,
)
from ..checks.schema import DEFAULT_LIMITS as _L
from ..checks.schema import Cap, check, parses
from ..errors import InvalidRequest


class TreeBody(ConstraintFields):
    """POST /v1/tree (a logprobe extension: every field is logprobe's, named as OpenAI and vLLM name
    the ones they share)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "smollm2-135m", "prompt": "The capital of France is", "depth": 3, "branches": 5},
        {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Pick a colour."}], "depth": 2,
         "branches": 10, "branch_p": 0.9, "temperature": 0.7},
    ]})

    model: str = Field(..., description="The model's name or one of its aliases.")
    prompt: Union[str, list[int]] | None = Field(None, description="A text or token ids (or `messages`, not both).")
    messages: list[Message] | None = Field(None, min_length=1, description="A conversation, rendered with the "
                                           "model's chat template (or `prompt`, not both).")
    depth: Annotated[int | None, Cap("max_tree_depth")] = Field(
        2, ge=1, le=_L.max_tree_depth, description="Levels of tokens below the prompt (cap: --max-tree-depth).")
    branches: Annotated[int | None, Cap("max_tree_branches")] = Field(
        5, ge=1, le=_L.max_tree_branches, description="The most children of a node: its likeliest tokens in the "
        "processed distribution (cap: --max-tree-branches; the whole tree: --max-tree-nodes).")
    branch_p: float | None = Field(None, gt=0, le=1, description="Instead of always `branches` children: the "
                                   "fewest likeliest whose processed probability reaches p, at most `branches`.")
    temperature: Temperature
    top_p: TopP
    top_k: TopK
    logit_bias: LogitBias
    response_format: ResponseFormatField
    structured_outputs: StructuredOutputsField
    allowed_token_ids: AllowedTokenIds
    bad_words: BadWords
    add_special_tokens: bool | None = Field(True, description="With a text prompt: let the tokenizer add its "
                                            "special tokens (BOS) in front.")
    return_tokens_as_token_ids: TokensAsIds
    user: User

    parse_logit_bias = staticmethod(SamplingFields.parse_logit_bias)
    parse_allowed_token_ids = staticmethod(SamplingFields.parse_allowed_token_ids)
    parse_bad_words = staticmethod(SamplingFields.parse_bad_words)

    @parses("prompt")
    def parse_prompt(value, limits: Limits) -> str | list[int] | None:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and value and all_ints(value):
            return list(value)
        if isinstance(value, list) and not value:
            raise v.value_error("prompt", "a non-empty prompt")
        raise v.type_error("prompt", "a string or an array of token ids")

    @parses("messages")
    def parse_messages(value, limits: Limits) -> list[dict] | None:
        return None if value is None else message_list(value)

    @check
    def check_one_prompt(self, limits: Limits) -> None:
        if self.prompt is None and self.messages is None:
            # no param: neither field is required alone (the schema cannot say "one of the two")
            raise InvalidRequest("Missing required parameter: 'prompt' (or 'messages').")
        if self.prompt is not None and self.messages is not None:
            raise InvalidRequest("Send either 'prompt' or 'messages', not both.", "messages")

    @check
    def check_tree_size(self, limits: Limits) -> None:
        """The tree is held (admission) at its largest, so its largest must fit the node cap."""
        nodes = self.shape.max_nodes
        if nodes > limits.max_tree_nodes:
            param = "depth" if self.depth > 1 else "branches"
            raise InvalidRequest(
                f"A tree of depth {self.depth} with {self.branches} branches per node has up to {nodes} nodes, "
                f"over this server's cap of {limits.max_tree_nodes} (max_tree_nodes). Lower 'depth' or "
                "'branches' ('branch_p' does not lower the bound: a tree is held at its largest).", param)

    @property
    def shape(self) -> TreeShape:
        return TreeShape(self.depth, self.branches, self.branch_p)
