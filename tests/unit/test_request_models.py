"""The request models (api/<endpoint>/protocol.py, api/checks/): one declaration per body gives both the checks, with the contract's
messages, and the OpenAPI schema. These run the models without a server."""

from __future__ import annotations

import pytest

from logprobe.api.errors import InvalidRequest
from logprobe.api.registry import BODIES
from logprobe.api.chat.protocol import ChatBody
from logprobe.api.completions.protocol import CompletionBody
from logprobe.api.score.protocol import ScoreBody
from logprobe.backend import SamplingParams
from logprobe.config import Limits

MINIMAL = {
    "/v1/completions": {"model": "m", "prompt": "hi"},
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": "m", "input": "hi"},
    "/v1/score": {"model": "m", "input": "hi"},
    "/v1/compare": {"models": ["a", "b"], "input": "hi"},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2]},
    "/v1/tree": {"model": "m", "prompt": "hi"},
}


def refusal(model, body, limits=None) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        model.parse(body, limits or Limits())
    return caught.value


@pytest.mark.parametrize("path", sorted(BODIES))
def test_every_field_is_checked_and_described(path):
    """Each declared field is read by parse (declared type or its own parser) and is in the schema."""
    model = BODIES[path]
    req = model.parse(MINIMAL[path], Limits())  # a field no check covers raises TypeError here
    schema = model.model_json_schema()
    assert set(schema["properties"]) == set(model.model_fields)
    assert set(schema.get("required", [])) == model.required_fields()  # JSON Schema leaves out an empty list
    assert set(model.implemented_fields()) <= set(req.__dict__)


def test_a_bound_that_is_a_server_option_follows_the_server():
    """The schema shows a cap at its default; the check uses the server's value."""
    assert CompletionBody.model_json_schema()["properties"]["n"]["anyOf"][0]["maximum"] == 16
    err = refusal(CompletionBody, {**MINIMAL["/v1/completions"], "n": 5}, Limits(max_n=4))
    assert (err.message, err.param) == ("Invalid value for 'n': expected a value less than or equal to 4.", "n")
    err = refusal(ChatBody, {**MINIMAL["/v1/chat/completions"], "logprobs": True, "top_logprobs": 8},
                  Limits(max_logprobs=7))
    assert err.message == "Invalid value for 'top_logprobs': expected a value less than or equal to 7."
    err = refusal(BODIES["/v1/responses"], {**MINIMAL["/v1/responses"], "include": ["message.output_text.logprobs"],
                                            "top_logprobs": 8}, Limits(max_logprobs=7))
    assert err.message == "Invalid value for 'top_logprobs': expected a value less than or equal to 7."


def test_max_tokens_has_no_int64_bound():
    """max_tokens is bounded by the model's context (a later check), not by the int64 range."""
    req = CompletionBody.parse({**MINIMAL["/v1/completions"], "max_tokens": 2**63}, Limits())
    assert req.max_tokens == 2**63
    err = refusal(CompletionBody, {**MINIMAL["/v1/completions"], "top_k": 2**63})
    assert err.message == "Invalid value for 'top_k': expected a value less than or equal to 9223372036854775807."


def test_order_unknown_fields_then_fields_in_order_then_rules():
    body = {**MINIMAL["/v1/completions"], "temperature": "hot", "n": "2", "bogus": 1}
    assert refusal(CompletionBody, body).message == "Unrecognized request argument supplied: bogus"
    del body["bogus"]
    assert refusal(CompletionBody, body).param == "n"  # n comes before temperature in OpenAI's order
    body = {**MINIMAL["/v1/completions"], "stream": True, "prompt_logprobs": 1, "vocab_encoding": "float16"}
    assert refusal(CompletionBody, body).param == "prompt_logprobs"  # the rules run in the order written


def test_neutral_fields_take_only_their_neutral_values():
    for value in (None, 0):
        CompletionBody.parse({**MINIMAL["/v1/completions"], "presence_penalty": value}, Limits())
    err = refusal(CompletionBody, {**MINIMAL["/v1/completions"], "presence_penalty": 0.5})
    assert err.message == ("Unsupported request argument supplied: presence_penalty (logprobe does not implement "
                           "it; leave it out or send 0).")
    err = refusal(CompletionBody, {**MINIMAL["/v1/completions"], "suffix": "x"})
    assert err.message.endswith("leave it out or send null).")


def test_literal_fields_list_their_values():
    err = refusal(CompletionBody, {**MINIMAL["/v1/completions"], "logprobs_mode": "cooked"})
    assert err.message == "Invalid value for 'logprobs_mode': expected 'raw', 'processed' or 'both'."
    err = refusal(CompletionBody, {**MINIMAL["/v1/completions"], "logprobs_mode": 1})
    assert err.message == "Invalid type for 'logprobs_mode': expected a string or null."


def test_a_request_without_extensions_has_the_default_parameters():
    req = CompletionBody.parse(MINIMAL["/v1/completions"], Limits())
    params = SamplingParams(max_tokens=req.max_tokens, logprobs=req.logprobs, echo=req.echo,
                            **req.sampling_kwargs(Limits()))
    assert params == SamplingParams(max_tokens=16)


def test_null_is_the_default():
    body = {**MINIMAL["/v1/score"], "add_bos": None, "context": None, "top_logprobs": None}
    req = ScoreBody.parse(body, Limits())
    assert (req.add_bos, req.contexts, req.top_logprobs) == (True, [None], None)
    err = refusal(ScoreBody, {"model": None, "input": "x"})
    assert (err.message, err.param) == ("Missing required parameter: 'model'.", "model")
