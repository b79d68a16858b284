"""What a finished group asked to read beside its tokens: activations, the logit lens, and its tokens'
log probabilities without its interventions. Each is one pass over every kept token of a choice, prompt
then generated: a generated token's vector is the one computed when it is the input (the same as during
decoding, without keeping hooks on the decode loop). Choices with the same tokens share the pass.
"""

from __future__ import annotations

from .request import SequenceGroup


def wants_captures(group: SequenceGroup) -> bool:
    """Whether the group's request reads anything beside its tokens once it finishes (its captures are
    then an item of the engine's next plan: Plan.captures)."""
    params = group.params
    return bool(params.residual_layers or params.lens_layers or params.return_unmodified)


def capture_finished(runner, group: SequenceGroup, num_layers: int) -> None:
    """Fill the captures the group's request asked for on its sequences (`num_layers`: the model's)."""
    params = group.params
    if params.residual_layers:
        capture_residual(runner, group)
    if params.lens_layers:
        layers = sorted({layer % (num_layers + 1) for layer in params.lens_layers})
        _per_choice(group, "lens", lambda ids: runner.logit_lens(ids, layers, params.lens_top_k, group.edits))
    if params.return_unmodified:
        # the last layer's lens without the edits is the model's own distribution, as wide a top-k as
        # the request's `logprobs` and `prompt_logprobs` ask
        k = max(params.logprobs or 0, params.num_prompt_top)
        _per_choice(group, "unmodified", lambda ids: runner.logit_lens(ids, [num_layers], k)[num_layers])


def capture_residual(runner, group: SequenceGroup) -> None:
    """Each choice's activations at the asked layers ({layer: [prompt + kept tokens, D]})."""
    layers = list(group.params.residual_layers)
    _per_choice(group, "residual", lambda ids: runner.residual_stream(ids, layers, group.edits))


def _per_choice(group: SequenceGroup, name: str, capture) -> None:
    """Set `name` on each sequence to `capture(prompt + kept tokens)`, once per distinct token list."""
    by_tokens: dict[tuple[int, ...], object] = {}
    for seq in group.sequences:
        ids = tuple(group.prompt_ids) + tuple(seq.token_ids[:seq.num_kept_tokens])
        if ids not in by_tokens:
            by_tokens[ids] = capture(list(ids))
        setattr(seq, name, by_tokens[ids])
