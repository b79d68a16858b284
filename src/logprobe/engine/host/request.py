"""What the engine keeps of a request while it runs: its sequences, their columns and random streams.

The engine turns each `GenerationRequest` (backend/) into a `SequenceGroup` (one prompt and its `n`
choices), fills its numpy columns step by step (output_processor.py), and hands back a
`GenerationOutput`. No torch here: the engine's test double (tests/fake_backend.py) keeps the same state.
"""

from __future__ import annotations

import numpy as np

from ...backend import (ChoiceOutput, FinishReason, GenerationOutput, GenerationRequest, PositionColumns,
    PromptColumns, SamplingParams)
from ...tokens import TextAssembler, TokenTable
from .random_streams import Stream

__all__ = ["FinishReason", "PromptColumns", "SamplingParams", "SequenceState", "SequenceGroup", "RowLog"]


class SequenceState:
    """One choice: the tokens it generated, their log probabilities and its text so far."""

    def __init__(self, index: int, params: SamplingParams, table: TokenTable, text_start: int):
        self.index = index
        # one stream per choice, fixed by (seed, index): the same whatever else the server runs
        self.stream = Stream(params.seed, index)
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_ids: list[np.ndarray] = []
        self.top_logprobs: list[np.ndarray] = []
        self.text = TextAssembler(table, start=text_start)
        self.finish_reason: FinishReason | None = None
        self.num_kept: int | None = None  # tokens kept after a stop string cut the text
        self.text_end: int | None = None  # length of the generated text after the cut
        self.residual: dict[int, np.ndarray] | None = None  # layer -> [prompt + kept tokens, D]
        self.lens: dict | None = None  # layer -> PromptColumns of prompt + kept tokens (logit lens)
        self.unmodified: PromptColumns | None = None  # prompt + kept tokens without the interventions
        self.rows: RowLog | None = None  # instrument rows, for a request that asked for instruments
        self.grammar = None  # a constrained request's grammar state (engine/host/grammar.py), set when it starts

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def next_seed(self) -> int:
        """The seed of the random numbers its next token is drawn with (random_streams.py)."""
        return self.stream.seed(len(self.token_ids))

    @property
    def num_kept_tokens(self) -> int:
        return len(self.token_ids) if self.num_kept is None else self.num_kept

    def output(self, k: int, params: SamplingParams) -> ChoiceOutput:
        ids, lps, top_ids, top_lps = self.columns(k)
        text = self.text.text if self.text_end is None else self.text.text[: self.text_end]
        out = ChoiceOutput(self.index, ids, lps, top_ids, top_lps, list(self.text.offsets[: len(ids)]), text,
                           self.finish_reason.value, len(self.token_ids), self.residual, self.lens)
        if params.needs_position_columns or params.records_processed or params.is_masked:
            self.add_instruments(out, k, params)
        out.unmodified = self.unmodified
        return out

    def add_instruments(self, out: ChoiceOutput, k: int, params: SamplingParams) -> None:
        kept = len(out.token_ids)
        log = self.rows or RowLog()
        out.extras = log.position_columns(params, kept)
        if params.logprobs_mode == "both" and params.logprobs is not None:
            out.processed_logprobs = np.asarray(log.processed_logprobs[:kept], dtype=np.float32)
            out.processed_top_logprobs = (np.stack(log.processed_top_logprobs[:kept])[:, :k] if kept and k
                                          else np.zeros((kept, k), dtype=np.float32))
            if log.processed_top_ids and kept and k:  # steered: its own top-k (else that of top_ids)
                out.processed_top_ids = np.stack(log.processed_top_ids[:kept])[:, :k]
        if params.is_masked and params.logprobs is not None:
            out.constraint_logprobs = np.asarray(log.constraint_logprobs[:kept], dtype=np.float32)

    def columns(self, k: int, start: int = 0, stop: int | None = None):
        """(ids, logprobs, top ids [., k], top logprobs [., k]) of kept tokens start..stop. Streaming
        asks for just the new tokens, so a long stream does not re-stack its history every step."""
        kept = len(self.token_ids) if self.num_kept is None else self.num_kept
        stop = kept if stop is None else min(stop, kept)
        start = min(start, stop)
        ids = np.asarray(self.token_ids[start:stop], dtype=np.int64)
        lps = np.asarray(self.logprobs[start:stop], dtype=np.float32)
        if stop > start and k:
            top_ids = np.stack(self.top_ids[start:stop])[:, :k]
            top_lps = np.stack(self.top_logprobs[start:stop])[:, :k]
        else:
            top_ids = np.zeros((stop - start, k), dtype=np.int64)
            top_lps = np.zeros((stop - start, k), dtype=np.float32)
        return ids, lps, top_ids, top_lps


class SequenceGroup:
    """One prompt and its `n` choices; the unit the scheduler prefills and decodes."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 table: TokenTable, text_start: int = 0):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.sequences = [SequenceState(j, params, table, text_start) for j in range(params.n)]
        self.prompt_columns: PromptColumns | None = None
        self.edits = None  # its interventions, resolved before its first pass (interventions.py)
        self.num_computed_tokens = 0  # prompt tokens prefilled so far (the scheduler counts them)
        # prompt tokens whose keys and values came from the prefix cache instead of a pass (the runner
        # says how many as the prompt finishes: usage's cached_tokens)
        self.num_cached_tokens = 0
        self.active_rows: list[int] = []  # sequence index of each row of the KV cache batch
        self.is_aborted = False
        self.error: BaseException | None = None
        self.on_finish = None  # callable, set by the engine's async front
        self.on_step = None  # callable(group), run on the engine thread after each step (streaming)
        self.steering = None  # engine/device/steering.py's Steering of a steered request, built at its first pick
        self.grammar_masks = None  # [(allowed [V] bool, accepting, drawn)] per active row, for its next pick
        self.priority = "interactive"  # or "batch": waits for what interactive groups leave (scheduler.py)

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.sequences)

    @property
    def is_batch(self) -> bool:
        return self.priority == "batch"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def has_instruments(self) -> bool:
        """Whether its generated tokens carry instrument columns (instruments.pick_with_instruments)."""
        return self.params.needs_position_columns or self.params.records_processed

    @property
    def picks_alone(self) -> bool:
        """Whether its rows are picked by instruments.pick_with_instruments, not with the plain rows'
        one batched pick: it asked for instruments, or something steers its draw (steering.py)."""
        return self.has_instruments or self.params.is_steered

    @classmethod
    def from_request(cls, request: GenerationRequest, table: TokenTable) -> "SequenceGroup":
        group = cls(request.request_id, list(request.prompt_ids), request.params, table, request.text_start)
        group.priority = request.priority
        return group

    def output(self) -> GenerationOutput:
        k = self.params.logprobs or 0
        return GenerationOutput(self.request_id, self.num_prompt_tokens, self.prompt_columns,
                                [seq.output(k, self.params) for seq in self.sequences],
                                num_cached_tokens=self.num_cached_tokens)


class RowLog:
    """A choice's instrument rows, one per generated token (numpy rows, stacked at the end)."""

    def __init__(self):
        self.columns: dict[str, list] = {}
        self.processed_logprobs: list[float] = []
        self.processed_top_logprobs: list[np.ndarray] = []
        self.processed_top_ids: list[np.ndarray] = []  # a steered request's own processed top-k
        self.constraint_logprobs: list[float] = []  # a masked request's allowed log mass

    def add(self, name: str, value) -> None:
        self.columns.setdefault(name, []).append(value)

    def position_columns(self, params: SamplingParams, stop: int) -> PositionColumns | None:
        """The columns of the first `stop` generated tokens (those a stop string's cut kept)."""
        if not params.needs_position_columns:
            return None
        out = PositionColumns(top_p=params.top_logprobs_p)
        if params.logprob_token_ids:
            out.token_ids = np.asarray(params.logprob_token_ids, dtype=np.int64)
        for name, dtype, width in generated_columns(params):
            values = self.columns.get(name)
            if values:
                setattr(out, name, np.asarray(values, dtype=dtype)[:stop])
            else:  # nothing generated
                setattr(out, name, np.zeros((0,) if width is None else (0, width), dtype=dtype))
        return out


def generated_columns(params: SamplingParams) -> list[tuple[str, type, int | None]]:
    """(name, dtype, row width or None) of each PositionColumns column a request's generated rows have."""
    out = []
    if params.logprob_token_ids:
        num = len(params.logprob_token_ids)
        out += [("token_id_logprobs", np.float32, num), ("token_id_ranks", np.int64, num)]
        if params.records_processed:
            out.append(("token_id_logprobs_processed", np.float32, num))
    if params.position_stats:
        out += [("entropy", np.float32, None), ("ranks", np.int64, None)]
    if params.top_logprobs_p is not None:
        cap = params.max_top_p_tokens
        out += [("top_p_ids", np.int64, cap), ("top_p_logprobs", np.float32, cap), ("top_p_counts", np.int64, None),
                ("top_p_mass", np.float32, None), ("top_p_truncated", bool, None)]
    return out
