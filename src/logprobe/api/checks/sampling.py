"""The fields completions and chat share, declared once: each an annotated type that a request model
names in its own field order, their checks (`@parses`), the rules between them (`@check`), and the
hand-off to the engine (`SamplingFields.sampling_kwargs`)."""

from __future__ import annotations

import contextlib
import typing
from dataclasses import dataclass
from typing import Annotated, Literal, Union

from pydantic import Field

from ...config import Limits
from ..errors import InvalidRequest
from . import validation as v
from .interventions import parse_intervention
from .schema import DEFAULT_LIMITS as _L
from .schema import Cap, RequestModel, check, parses

INT64 = dict(ge=-(2**63), le=2**63 - 1)


@contextlib.contextmanager
def inside(name: str):
    """Errors about a key inside the object field `name` name it as `name.key`."""
    try:
        yield
    except InvalidRequest as exc:
        if exc.param and exc.param != name and not exc.param.startswith(name + "."):
            exc.param = f"{name}.{exc.param}"
        elif not exc.param:
            exc.param = name
        raise


# ---- objects inside fields (their shapes, for the schema; their checks are the parsers below) -------


class StreamOptions(RequestModel):
    include_usage: bool = Field(False, description="A last chunk with `usage` (and `usage: null` in the others).")
    continuous_usage_stats: bool = Field(False, description="Accepted for vLLM clients; no effect.")


class ResidualStreamOptions(RequestModel):
    layers: list[int] = Field(..., min_length=1, description="Layer indices: 0 is the embeddings (block 0's "
                              "input), l >= 1 block l's output; negative counts from the end (-1 is the last).")
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    encoding: Literal["base64", "json"] = Field("base64", description="base64 of the little-endian array "
                                                "[positions, d_model], or nested JSON lists.")


class LensOptions(RequestModel):
    layers: list[int] = Field(..., min_length=1, description="Layer indices, as for output_residual_stream.")
    top_k: int = Field(5, ge=0, le=_L.max_logprobs, description="The k likeliest tokens at each position.")


class PatchSource(RequestModel):
    prompt: Union[str, list[int]] = Field(..., description="Another prompt (a text, tokenized as a prompt is, "
                                          "or token ids) whose residual stream is patched in.")
    position: int = Field(-1, description="Its position to read (negative: from its end).")
    layer: int | None = Field(None, description="Its layer to read; default: the intervention's layer.")


class InterventionItem(RequestModel):
    layer: int = Field(..., description="Where: 0 the embeddings, l block l's output (as for "
                       "output_residual_stream); negative counts from the end.")
    op: Literal["add", "scale", "zero", "set", "patch"] = Field(..., description="x + vector, x * factor, 0, "
                                                                 "vector, or another prompt's stream.")
    positions: list[int] | None = Field(None, min_length=1, description="Token positions, prompt then "
                                        "generated; negative: from the prompt's end; null: every position.")
    vector: Union[str, list[float]] | None = Field(None, description="add, set: d_model values, as base64 of "
                                                    "little-endian float32 or an array of numbers.")
    factor: float | None = Field(None, description="scale: the factor.")
    source: PatchSource | None = Field(None, description="patch: where the vector comes from.")


@dataclass
class ResidualRequest:
    """`output_residual_stream`, checked."""

    layers: list[int]
    dtype: str = "float32"
    encoding: str = "base64"


# ---- the shared fields ------------------------------------------------------------------------------

Temperature = Annotated[float | None, Field(1.0, ge=0, le=2, description="0 (or below 1e-5) is greedy.")]
TopP = Annotated[float | None, Field(1.0, gt=0, le=1, description="Nucleus sampling.")]
N = Annotated[int | None, Field(1, ge=1, le=_L.max_n, description="Choices per prompt (cap: --max-n)."),
              Cap("max_n")]
Stop = Annotated[str | list[str] | None, Field(None, description=f"Up to {_L.max_stop} stop strings; the text "
                                               "ends before the first one, which is not returned.")]
Seed = Annotated[int | None, Field(None, **INT64, description="Same seed and request: same output, whatever "
                                   "the server batched it with.")]
Stream = Annotated[bool | None, Field(False, description="Server-sent events, one chunk per choice per step.")]
StreamOptionsField = Annotated[StreamOptions | None, Field(None, description="Only with stream: true.")]
User = Annotated[str | None, Field(None, description="Recorded, unused.")]
TopK = Annotated[int | None, Field(-1, ge=-1, description="logprobe/vLLM extension; -1 or 0: off.")]
PromptLogprobs = Annotated[int | None, Field(None, ge=-1, le=_L.max_logprobs, description=(
    "Log probabilities of the prompt's tokens with the k likeliest at each position; -1: the whole "
    "vocabulary (cap: --max-vocab-positions). Not with stream.")), Cap("max_logprobs")]
VocabEncoding = Annotated[Literal["float32", "float16"] | None, Field(None, description=(
    "With prompt_logprobs -1: each position's vocabulary as base64 of a little-endian array."))]
ResidualStream = Annotated[Union[list[int], ResidualStreamOptions] | None, Field(None, description=(
    "Activations at these layers for every prompt and generated position. Not with stream."))]
Lens = Annotated[Union[list[int], LensOptions] | None, Field(None, description=(
    "The logit lens: these layers read through the final norm and the head at every prompt and generated "
    "position (log probability and rank of each token, the k likeliest). Cap: --max-lens-rows. Not with "
    "stream."))]
TokensAsIds = Annotated[bool | None, Field(False, description="Tokens as `token_id:N`.")]
LogprobTokenIds = Annotated[list[int] | None, Field(None, max_length=_L.max_logprob_token_ids, description=(
    "These token ids' log probabilities and ranks at every prompt and generated position (the choice's "
    "`logprob_token_ids`); with logprobs, each generated token's top_logprobs holds the token and these ids "
    "instead of the k likeliest (vLLM). Cap: --max-logprob-token-ids. Not with stream."))]
PositionStats = Annotated[bool | None, Field(False, description=(
    "Entropy (nats) of every prompt and generated position's distribution and the actual token's rank (the "
    "choice's `position_stats`). Not with stream."))]
TopLogprobsP = Annotated[float | None, Field(None, gt=0, le=1, description=(
    "At every position, the smallest set of likeliest tokens whose probability reaches p (at most "
    "--max-top-p-tokens, else `truncated`), in `position_stats`. Not with stream."))]
LogprobsMode = Annotated[Literal["raw", "processed", "both"] | None, Field("raw", description=(
    "raw: log probabilities of the model's distribution; processed: of the distribution each token was drawn "
    "from (after logit_bias, allowed_token_ids, bad_words, a constraint, temperature, top-k, top-p); both: raw, "
    "plus `processed_logprobs`."))]
Interventions = Annotated[list[InterventionItem] | None, Field(None, max_length=_L.max_interventions,
                                                                description=(
    "Changes to the residual stream of this request's forward passes, in order; the log probabilities "
    "returned are those under them. Cap: --max-interventions."))]
ReturnUnmodified = Annotated[bool | None, Field(False, description=(
    "With interventions: each choice's `unmodified` block, the same tokens' log probabilities without them. "
    "Not with stream."))]

LogitBias = Annotated[dict[str, float] | None, Field(None, description=(
    "OpenAI's: token id (as a string) -> a bias from -100 to 100, added to the token's log probability before "
    "the draw (-100 bans it, 100 all but forces it). Shapes the processed distribution only, never the raw one "
    "(logprobs_mode). Cap: --max-logit-bias ids."))]
AllowedTokenIds = Annotated[list[int] | None, Field(None, min_length=1, description=(
    "vLLM extension: only these token ids may be drawn. Shapes the processed distribution only; with logprobs, "
    "each choice's `constraint_logprobs` is the raw probability mass they hold at each position."))]
BadWords = Annotated[list[str] | None, Field(None, max_length=_L.max_bad_words, description=(
    "vLLM extension: words never generated. Each is tokenized with and without a leading space; a token that "
    "would complete one after its other tokens is not drawn. Cap: --max-bad-words."))]

MinTokens = Annotated[int | None, Field(0, ge=0, description=(
    "vLLM extension: no stop token or stop string ends a choice before it has this many tokens (the stop tokens "
    "are masked until then). At most max_tokens."))]
IgnoreEos = Annotated[bool | None, Field(False, description=(
    "vLLM extension: generation goes on past the end-of-sequence tokens until max_tokens (stop strings still "
    "apply)."))]

SkipSpecialTokens = Annotated[bool | None, Field(True, description=(
    "vLLM's: the special tokens (those the tokenizer marks special: the end of turn, SmolLM2's `<repo_name>`, ...) "
    "write no text into the generated text, as transformers' decode(skip_special_tokens=True); false writes "
    "theirs too. The stop token that ends a choice never writes its text. `tokens` and the log probabilities "
    "are the same either way."))]

STREAMED_INSTRUMENTS = ("logprob_token_ids", "position_stats", "top_logprobs_p")


def checked_object(name: str, value, model: type[RequestModel]) -> dict | None:
    """An object field (None when null), its keys checked against `model`'s."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise v.type_error(name, "an object")
    with inside(name):
        model.check_known_fields(value)
    return value


def _layer_list(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(x, int) and not isinstance(x, bool)
                                                            for x in value)


def _options(name: str, value, model: type[RequestModel]) -> dict | None:
    """A field that is an array of layer indices or an object of `model`'s keys, as that object."""
    if value is None:
        return None
    if isinstance(value, list):
        value = {"layers": value}
    if not isinstance(value, dict):
        raise v.type_error(name, "an array of layer indices or an object")
    with inside(name):
        model.check_known_fields(value)
    if not _layer_list(value.get("layers")):
        raise InvalidRequest(f"Invalid value for '{name}': 'layers' must be a non-empty array of layer "
                             "indices.", name)
    return value


def _choices(model: type[RequestModel], key: str) -> tuple[str, ...]:
    return typing.get_args(model.model_fields[key].annotation)


class SamplingFields(RequestModel):
    """Checks and rules of the shared fields (a request model names the fields it has)."""

    @parses("stop")
    def parse_stop(value, limits: Limits) -> list[str]:
        return v.get_stop({"stop": value}, max_items=limits.max_stop)

    @parses("stream_options")
    def parse_stream_options(value, limits: Limits) -> dict | None:
        value = checked_object("stream_options", value, StreamOptions)
        if value is None:
            return None
        with inside("stream_options"):
            return {"include_usage": v.get_bool(value, "include_usage", False),
                    "continuous_usage_stats": v.get_bool(value, "continuous_usage_stats", False)}

    @parses("output_residual_stream")
    def parse_residual(value, limits: Limits) -> ResidualRequest | None:
        """A list of layer indices, or {"layers", "dtype", "encoding"}."""
        name = "output_residual_stream"
        value = _options(name, value, ResidualStreamOptions)
        if value is None:
            return None
        dtypes, encodings = _choices(ResidualStreamOptions, "dtype"), _choices(ResidualStreamOptions, "encoding")
        dtype = value.get("dtype")
        dtype = "float32" if dtype is None else dtype
        if not isinstance(dtype, str) or dtype not in dtypes:
            raise InvalidRequest(f"Invalid value for '{name}': 'dtype' must be {', '.join(dtypes[:-1])} or "
                                 f"{dtypes[-1]}.", name + ".dtype")
        encoding = value.get("encoding")
        encoding = "base64" if encoding is None else encoding
        if not isinstance(encoding, str) or encoding not in encodings:
            raise InvalidRequest(f"Invalid value for '{name}': 'encoding' must be {' or '.join(encodings)}.",
                                 name + ".encoding")
        return ResidualRequest(list(value["layers"]), dtype, encoding)

    @parses("output_lens")
    def parse_lens(value, limits: Limits) -> dict:
        """A list of layer indices, or {"layers", "top_k"}: SamplingParams keywords."""
        name = "output_lens"
        value = _options(name, value, LensOptions)
        if value is None:
            return {}
        top_k = value.get("top_k", 5)
        if top_k is None:
            top_k = 5
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not 0 <= top_k <= limits.max_logprobs:
            raise InvalidRequest(f"Invalid value for '{name}': 'top_k' must be an integer from 0 to "
                                 f"{limits.max_logprobs}.", name + ".top_k")
        return {"lens_layers": tuple(value["layers"]), "lens_top_k": top_k}

    @parses("logprob_token_ids")
    def parse_logprob_token_ids(value, limits: Limits) -> tuple[int, ...]:
        """1..max_logprob_token_ids token ids (repeats allowed); [] is the same as leaving it out (vLLM).
        Ids outside the vocabulary are refused with the caps (caps.py)."""
        name = "logprob_token_ids"
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            raise v.type_error(name, "an array of token ids")
        if len(value) > limits.max_logprob_token_ids:
            raise InvalidRequest(
                f"Too many token ids in 'logprob_token_ids': this server takes at most "
                f"{limits.max_logprob_token_ids} (max_logprob_token_ids), and this request has {len(value)}.", name)
        return tuple(value)

    @parses("interventions")
    def parse_interventions(value, limits: Limits) -> tuple:
        name = "interventions"
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(x, dict) for x in value):
            raise v.type_error(name, "an array of objects")
        if len(value) > limits.max_interventions:
            raise InvalidRequest(f"Too many interventions: this server takes at most {limits.max_interventions} "
                                 f"in one request (max_interventions), and this one has {len(value)}.", name)
        return tuple(parse_intervention(item, f"{name}[{i}]") for i, item in enumerate(value))

    @parses("logit_bias")
    def parse_logit_bias(value, limits: Limits) -> tuple[tuple[int, float], ...]:
        """((token id, bias), ...) in the body's order; ids are checked against the vocabulary with the
        caps (api/checks/steering.py)."""
        name = "logit_bias"
        if value is None:
            return ()
        if not isinstance(value, dict):
            raise v.type_error(name, "an object mapping token ids to numbers")
        if len(value) > limits.max_logit_bias:
            raise InvalidRequest(f"Too many token ids in 'logit_bias': this server takes at most "
                                 f"{limits.max_logit_bias} (max_logit_bias), and this request has {len(value)}.",
                                 name)
        out, seen = [], set()
        for key, bias in value.items():
            token = key.strip()
            if not (token.isascii() and token.lstrip("-").isdigit()):
                raise InvalidRequest(f"Invalid key in 'logit_bias': {key[:40]!r} is not a token id (an integer "
                                     "written as a string).", name)
            if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not -100 <= bias <= 100:
                raise InvalidRequest(f"Invalid value for 'logit_bias' at token {key[:40]!r}: expected a number "
                                     "from -100 to 100.", name)
            if int(token) in seen:
                raise InvalidRequest(f"Invalid key in 'logit_bias': token {int(token)} appears more than once.", name)
            seen.add(int(token))
            out.append((int(token), float(bias)))
        return tuple(out)

    @parses("allowed_token_ids")
    def parse_allowed_token_ids(value, limits: Limits) -> tuple[int, ...] | None:
        name = "allowed_token_ids"
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            raise v.type_error(name, "an array of token ids")
        if not value:
            raise v.value_error(name, "at least one token id (an empty list would allow nothing)")
        return tuple(value)

    @parses("bad_words")
    def parse_bad_words(value, limits: Limits) -> tuple[str, ...]:
        name = "bad_words"
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise v.type_error(name, "an array of strings")
        if len(value) > limits.max_bad_words:
            raise InvalidRequest(f"Too many words in 'bad_words': this server takes at most {limits.max_bad_words} "
                                 f"(max_bad_words), and this request has {len(value)}.", name)
        if any(not w.strip() for w in value):
            raise v.value_error(name, "words that are not empty or only spaces")
        return tuple(value)

    # ---- rules between fields ----

    @check
    def check_stream_prompt_logprobs(self, limits: Limits) -> None:
        if self.stream and self.prompt_logprobs is not None:
            raise InvalidRequest("'prompt_logprobs' does not work with 'stream': true. Send the request without "
                                 "streaming to get prompt log probabilities.", "prompt_logprobs")

    @check
    def check_stream_options(self, limits: Limits) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("'stream_options' is only allowed with 'stream': true.", "stream_options")

    @check
    def check_vocab_encoding(self, limits: Limits) -> None:
        if self.vocab_encoding is not None and self.prompt_logprobs != -1:
            raise InvalidRequest("'vocab_encoding' is only used with 'prompt_logprobs': -1.", "vocab_encoding")

    @check
    def check_streamed_instruments(self, limits: Limits) -> None:
        if not self.stream:
            return
        for name in STREAMED_INSTRUMENTS:
            if getattr(self, name) not in (None, False, ()):
                raise InvalidRequest(f"'{name}' does not work with 'stream': true. Send the request without "
                                     "streaming to get it.", name)
        if self.output_residual_stream is not None:
            raise InvalidRequest("'output_residual_stream' does not work with 'stream': true. Send the request "
                                 "without streaming to get activations.", "output_residual_stream")
        if self.output_lens:
            raise InvalidRequest("'output_lens' does not work with 'stream': true. Send the request without "
                                 "streaming to get the logit lens.", "output_lens")

    @check
    def check_return_unmodified(self, limits: Limits) -> None:
        if not self.return_unmodified:
            return
        if not self.interventions:
            raise InvalidRequest("'return_unmodified' returns the log probabilities without the request's "
                                 "interventions, so it needs 'interventions'.", "return_unmodified")
        if self.stream:
            raise InvalidRequest("'return_unmodified' does not work with 'stream': true (it is computed when a "
                                 "choice is done). Send the request without streaming.", "return_unmodified")

    @check
    def check_min_tokens(self, limits: Limits) -> None:
        max_tokens, name = self.max_tokens_given
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise InvalidRequest(f"Invalid value for 'min_tokens': {self.min_tokens} is more than '{name}' "
                                 f"({max_tokens}); 'min_tokens' must be at most '{name}'.", "min_tokens")

    @property
    def max_tokens_given(self) -> tuple[int | None, str]:
        """(the request's max_tokens, the field's name); None where it is left to the context (chat)."""
        return self.max_tokens, "max_tokens"

    # ---- the hand-off to the engine ----

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options["include_usage"])

    def sampling_kwargs(self, limits: Limits) -> dict:
        """SamplingParams keyword arguments. The extensions appear only when set, so that a request
        without them has exactly the default parameters."""
        out = dict(temperature=self.temperature, top_p=self.top_p, n=self.n, stop=self.stop, seed=self.seed,
                   top_k=self.top_k, prompt_logprobs=self.prompt_logprobs)
        if self.logprob_token_ids:
            out["logprob_token_ids"] = self.logprob_token_ids
        if self.position_stats:
            out["position_stats"] = True
        if self.top_logprobs_p is not None:
            out["top_logprobs_p"] = self.top_logprobs_p
            out["max_top_p_tokens"] = limits.max_top_p_tokens
        if self.logprobs_mode != "raw":
            out["logprobs_mode"] = self.logprobs_mode
        out.update(self.output_lens)
        if self.interventions:
            out["interventions"] = self.interventions
        if self.return_unmodified:
            out["return_unmodified"] = True
        if self.logit_bias:
            out["logit_bias"] = self.logit_bias
        if self.allowed_token_ids is not None:
            out["allowed_token_ids"] = self.allowed_token_ids
        if self.min_tokens:
            out["min_tokens"] = self.min_tokens
        if self.ignore_eos:
            out["ignore_eos"] = True
        if getattr(self, "skip_special_tokens", None) is False:  # completions and chat
            out["skip_special_tokens"] = False
        if getattr(self, "constraint", None) is not None:  # bodies with ConstraintFields (constraints.py)
            out["constraint"] = self.constraint
        return out
