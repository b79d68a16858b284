"""What the engine keeps of a request while it runs: its sequences, their columns and random streams.

The engine turns each `GenerationRequest` (backend.py) into a `SequenceGroup` (one prompt and its `n`
choices), fills its numpy columns step by step, and hands back a `GenerationOutput`. This state is the
engine's own: nothing outside `engine/` reads or writes it.
"""

from __future__ import annotations

import numpy as np

from ..backend import (ChoiceOutput, FinishReason, GenerationOutput, GenerationRequest, PromptColumns,
                       SamplingParams)
from ..tokens import TextAssembler, TokenTable
from .instruments import Instruments, RowLog
from .streams import Stream

__all__ = ["FinishReason", "PromptColumns", "SamplingParams", "Sequence", "SequenceGroup"]


class Sequence:
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
        self.rows: RowLog | None = None  # instrument rows, for a request that asked (instruments.py)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def next_seed(self) -> int:
        """The seed of the random numbers its next token is drawn with (streams.py)."""
        return self.stream.seed(len(self.token_ids))

    @property
    def num_kept_tokens(self) -> int:
        return len(self.token_ids) if self.num_kept is None else self.num_kept

    def output(self, k: int, params: SamplingParams) -> ChoiceOutput:
        ids, lps, top_ids, top_lps = self.columns(k)
        text = self.text.text if self.text_end is None else self.text.text[: self.text_end]
        out = ChoiceOutput(self.index, ids, lps, top_ids, top_lps, list(self.text.offsets[: len(ids)]), text,
                           self.finish_reason.value, len(self.token_ids), self.residual, self.lens)
        if params.needs_position_columns or params.records_processed:
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
        self.sequences = [Sequence(j, params, table, text_start) for j in range(params.n)]
        self.prompt_columns: PromptColumns | None = None
        self.instruments = Instruments.of(params)  # None for a request that asks for none
        self.edits = None  # its interventions, resolved before its first pass (interventions.py)
        self.cache = None  # the model's KV cache while the group runs
        self.active_rows: list[int] = []  # sequence index of each row of the KV cache batch
        self.is_aborted = False
        self.error: BaseException | None = None
        self.on_finish = None  # callable, set by the engine's async front
        self.on_step = None  # callable(group), run on the engine thread after each step (streaming)

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.sequences)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @classmethod
    def from_request(cls, request: GenerationRequest, table: TokenTable) -> "SequenceGroup":
        return cls(request.request_id, list(request.prompt_ids), request.params, table, request.text_start)

    def output(self) -> GenerationOutput:
        k = self.params.logprobs or 0
        return GenerationOutput(self.request_id, self.num_prompt_tokens, self.prompt_columns,
                                [seq.output(k, self.params) for seq in self.sequences])
