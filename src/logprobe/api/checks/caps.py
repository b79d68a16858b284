"""The checks that need the model and the tokenized request: the context length and the size caps of
docs/api.md section 8, before any token is held."""

from __future__ import annotations

from ...backend import SamplingParams
from ...config import Limits
from ..errors import ContextLengthExceeded, InvalidRequest
from .constraints import compile_constraint
from .interventions import check_interventions
from .sampling import ResidualRequest
from .vocabulary import check_token_ids


def check_text_length(backend, texts, param: str) -> None:
    """Refuse, before tokenizing, texts that cannot fit the context whatever their tokens: no token
    covers more than the longest token's bytes (+1 for a tokenizer's added space), so a text of more
    than that x context bytes is over. Tokenizing a 10 MB prompt only to refuse it would take seconds."""
    ctx = backend.info.context_length
    per_token = backend.table.max_token_bytes + 1
    size = sum(len(t) for t in texts if isinstance(t, str)) * 4  # UTF-8 bytes, at most 4 a character
    if size <= ctx * per_token:
        return  # the common case, without encoding the text
    size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts if isinstance(t, str))
    if size > ctx * per_token:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {ctx} tokens. However, your text is {size} bytes long, "
            f"which is more than {size // per_token} tokens. Please reduce the {param}.", param)


def check_request_caps(backend, prompts: list[list[int]], params: SamplingParams,
                       residual: ResidualRequest | None, limits: Limits, prompt_param: str = "prompt",
                       max_tokens_param: str = "max_tokens", positions_param: str | None = None) -> None:
    """Every cap of docs/api.md section 8 that depends on the tokenized prompts, and the context length.
    A request that only reads its text (`/v1/score`, `/v1/compare`) names the text as both params."""
    compile_constraint(backend, params.constraint)  # the grammar for this model's tokens (cached)
    ctx = backend.info.context_length
    for ids in prompts:
        total = len(ids) + params.max_tokens
        if total > ctx and max_tokens_param == prompt_param:  # a text to read: nothing to generate
            raise ContextLengthExceeded(
                f"This model's maximum context length is {ctx} tokens. However, this {prompt_param} is "
                f"{len(ids)} tokens long (with its context and the BOS in front, if any). Please shorten the "
                f"{prompt_param} or its context.", prompt_param)
        if total > ctx:
            param = prompt_param if len(ids) >= ctx else max_tokens_param
            raise ContextLengthExceeded(
                f"This model's maximum context length is {ctx} tokens. However, you requested {total} "
                f"tokens ({len(ids)} in the prompt, {params.max_tokens} for the completion). "
                "Please reduce the prompt or max_tokens.", param)
    positions = sum(len(ids) for ids in prompts) * params.n
    if params.prompt_logprobs == -1:
        vocab = backend.info.vocab_size
        cap, flag = limits.vocab_positions(vocab, residual is not None)
        if positions > cap:
            with_residual = " with output_residual_stream" if residual is not None else ""
            why = (f"{flag}: {limits.max_vocab_entries:,} positions x vocabulary entries, {cap} positions of this "
                   f"model's {vocab:,} tokens" if flag == "max_vocab_entries" else flag)
            raise InvalidRequest(
                f"'prompt_logprobs': -1 returns the whole vocabulary at every prompt position, so it takes at "
                f"most {cap} prompt tokens x n, summed over the prompts{with_residual} ({why}); this request "
                f"has {positions}. Send fewer or shorter prompts, or a number k instead of -1.",
                "prompt_logprobs")
    if residual is not None:
        num_layers = backend.info.num_layers
        bad = [x for x in residual.layers if not -(num_layers + 1) <= x <= num_layers]
        if bad:
            raise InvalidRequest(f"Invalid value for 'output_residual_stream': layer {bad[0]} does not exist; "
                                 f"this model has layers 0 to {num_layers} (or -{num_layers + 1} to -1).",
                                 "output_residual_stream")
        vectors = sum(len(ids) + params.max_tokens for ids in prompts) * len(residual.layers) * params.n
        if vectors > limits.max_residual_vectors:
            raise InvalidRequest(
                f"Too many residual-stream vectors: positions x layers x n, summed over the prompts, is "
                f"{vectors}, over this server's cap of {limits.max_residual_vectors} (max_residual_vectors). "
                "Ask for fewer layers, positions or choices.", "output_residual_stream")
    if params.logprob_token_ids:
        check_token_ids(params.logprob_token_ids, backend.info.vocab_size, "logprob_token_ids")
    if params.lens_layers:
        num_layers = backend.info.num_layers
        bad = [x for x in params.lens_layers if not -(num_layers + 1) <= x <= num_layers]
        if bad:
            raise InvalidRequest(f"Invalid value for 'output_lens': layer {bad[0]} does not exist; this model "
                                 f"has layers 0 to {num_layers} (or -{num_layers + 1} to -1).", "output_lens")
        layers = len({x % (num_layers + 1) for x in params.lens_layers})
        rows = sum(len(ids) + params.max_tokens for ids in prompts) * layers * params.n
        if rows > limits.max_lens_rows:
            raise InvalidRequest(
                f"Too many logit-lens rows: positions x layers x n, summed over the prompts, is {rows}, over "
                f"this server's cap of {limits.max_lens_rows} (max_lens_rows). Each row is a pass of the "
                "head over the whole vocabulary; ask for fewer layers, positions or choices.", "output_lens")
    check_interventions(backend, prompts, params, limits)
    if params.needs_prompt_logits:
        if positions > limits.max_prompt_logprob_positions:
            param = positions_param or positions_field(params)
            raise InvalidRequest(
                f"Too many prompt log-probability positions: prompt tokens x n, summed over the prompts, "
                f"is {positions}, over this server's cap of {limits.max_prompt_logprob_positions} "
                "(max_prompt_logprob_positions).", param)


def positions_field(params: SamplingParams) -> str:
    """The field that made a request compute its prompt positions (named by the positions cap)."""
    if params.prompt_logprobs is not None:
        return "prompt_logprobs"
    if params.echo and params.logprobs is not None:
        return "logprobs"
    if params.logprob_token_ids:
        return "logprob_token_ids"
    return "position_stats" if params.position_stats else "top_logprobs_p"
