"""Scoring rows in process: each row a /v1/score request through the API's pipeline (api/serving/pipeline.py)
on an engine of this process, so a row passes the same checks as a request and its numbers are the API's.
A row goes in typed (`row_request`: api/score/serving.py's `request`, its fields checked as a body's are,
with the contract's messages) under a request id of its own, and its entry comes back typed (`ScoreEntry`,
what the API writes as JSON), never out of a formatted answer.

All rows of a call go to the engine at once (`Pipeline.run_together`), sorted so that rows with the same
context sit together (the prefix cache keeps a shared context's keys and values) and lengths grow
steadily; the engine batches prompt-only requests itself and stays full.
"""

from __future__ import annotations

import numpy as np

from ..api.errors import APIError, new_request_id
from ..api.registry import SCORE
from ..api.score import serving as scoring
from ..api.score.serving import ScoreEntry
from ..api.score.serving import entries as score_entries
from ..api.serving.holding import Call
from ..api.serving.pipeline import Pipeline
from ..config import Limits, SchedulerSettings, Settings
from .columns import ScoreOptions, asked_columns, empty_record, error_record, summary, to_table
from .io import DatasetError, Prepared, Row
from .job import run_sync
from .remote import RemoteScorer  # noqa: F401  (scorer.RemoteScorer is part of this module's interface)

__all__ = ["ScoreOptions", "InProcessScorer", "RemoteScorer", "Prepared"]

# Rows one prompt-only pass of an engine of its own may hold (the scheduler's `max_score_batch`; its
# padded-token budget, `score_batch_tokens`, still bounds the pass). The engine's default of 64 suits a
# server, where a pass holds an interactive request's step; a job's short rows (3 to 8 tokens) in passes
# of 64 make products of 192 to 512 rows, where a CPU's matrix products run below their rate at 1,024
# rows and more, and every pass pays its fixed work again (benchmarks/prompt_passes.py measures both).
PASS_ROWS = 1024


class InProcessScorer:
    """Scores rows on an engine in this process (`logprobe.engine.engine.Engine`, started)."""

    def __init__(self, engine, options: ScoreOptions = ScoreOptions()):
        self.engine = engine
        self.options = options
        self.pipeline = Pipeline(Limits(), backends=[engine])  # no admission: the job is the engine's only caller
        self.model_name = engine.info.name
        self._owns_engine = False

    @classmethod
    def from_model(cls, model: str | None = None, dtype: str = "float32", device: str = "cpu",
                   options: ScoreOptions = ScoreOptions()) -> "InProcessScorer":
        """Load `model` (a name `logprobe serve --model` takes; None: the bundled model) and start its
        engine. `close()` stops it."""
        from ..engine.engine import Engine  # torch: loaded when a model is, not when this module is
        from ..engine.runners import loader  # (as the line above)

        source = loader.resolve_source(model)
        # no interactive request shares this engine: its passes may hold PASS_ROWS rows
        engine = Engine.from_settings(Settings(model=model, dtype=dtype, device=device), source, source.aliases,
                                      scheduling=SchedulerSettings(max_score_batch=PASS_ROWS))
        engine.start()
        scorer = cls(engine, options)
        scorer._owns_engine = True
        return scorer

    def close(self) -> None:
        """Stop the engine if `from_model` started it."""
        if self._owns_engine:
            self.engine.stop()
            self._owns_engine = False

    # ---- the steps ----------------------------------------------------------------------------
    def prepare(self, rows: list[Row]) -> list[Prepared]:
        """Check every row as /v1/score would (the pipeline's checks); a row that cannot be scored gets
        its reason."""
        out = []
        for row in rows:
            if not row.scored:
                out.append(Prepared(row))
                continue
            try:
                # a request id of its own: the engine's abort and progress see each row as its request
                checked = self.pipeline.check(SCORE, row_request(row, self.model_name, self.options), new_request_id())
            except APIError as exc:
                out.append(Prepared(row, error=exc.message))
                continue
            out.append(Prepared(row, item=checked))
        return out

    def refuse_invalid(self, prepared: list[Prepared]) -> None:
        """Without skip_invalid, a row that cannot be scored ends the job before anything is scored."""
        bad = [p for p in prepared if p.error is not None]
        if bad and not self.options.skip_invalid:
            first = bad[0]
            more = f" (and {len(bad) - 1} more rows: {', '.join(p.row.id for p in bad[1:4])}" \
                   f"{', ...' if len(bad) > 4 else ''})" if len(bad) > 1 else ""
            raise DatasetError(f"row {first.row.index} (id {first.row.id!r}) cannot be scored: {first.error}{more} "
                               "(--skip-invalid scores the others and records why in an 'error' column)")

    async def run(self, prepared: list[Prepared], on_rows=None) -> list[dict]:
        """Records (see columns.py) of prepared rows, in the given order; `on_rows(rows, tokens)` once
        they are back (one run of the engine)."""
        todo = sorted((p for p in prepared if p.item is not None),
                      key=lambda p: (p.row.context or "", p.num_tokens))
        records: dict[int, dict] = {}
        if todo:
            answers = await self.pipeline.run_together([p.item for p in todo], Call(new_request_id()), formatted=False)
            for p, answer in zip(todo, answers):
                checked = p.item
                (entry,) = score_entries(checked.target, checked.req, checked.prepared, answer.outputs)
                records[p.row.index] = self._record(p, entry, answer.outputs[0].prompt_columns)
        for p in prepared:
            if p.error is not None:
                records[p.row.index] = error_record(p.row.id, p.error)
            elif p.item is None:
                records[p.row.index] = empty_record(p.row.id, self.options)
        if on_rows is not None:
            on_rows(len(prepared), sum(r.get("num_tokens") or 0 for r in records.values()))
        return [records[p.row.index] for p in prepared]

    def score(self, rows: list[Row]):
        """A pyarrow Table of the rows' scores, in the order given (columns.py names the columns)."""
        prepared = self.prepare(rows)
        self.refuse_invalid(prepared)
        return to_table(run_sync(self.run(prepared)), self.options)

    # ---- helpers ------------------------------------------------------------------------------
    def _record(self, p: Prepared, entry: ScoreEntry, columns) -> dict:
        """One row's record from its /v1/score entry (typed, as the API computes it) and, for top-k, the
        engine's columns."""
        opts, item = self.options, p.item.prepared[0]
        first = item.first
        record = summary(p.row.id, entry.num_tokens, entry.logprob, entry.mean_logprob, entry.perplexity)
        if opts.tokens:
            record.update(tokens=entry.tokens, token_ids=entry.token_ids, token_logprobs=entry.token_logprobs,
                          ranks=entry.token_ranks)
        scored = slice(first, len(item.token_ids))
        unpredicted = first == 0  # nothing predicts the first token: its entries are null
        if opts.top:
            top_ids = columns.top_ids[scored, :opts.top]
            strings = self.engine.table.strings
            record["top_ids"] = top_ids.tolist()
            record["top_tokens"] = [strings[row].tolist() for row in top_ids]
            record["top_logprobs"] = columns.top_logprobs[scored, :opts.top].astype(np.float64).tolist()
            if unpredicted:
                for name in ("top_ids", "top_tokens", "top_logprobs"):
                    record[name][0] = None
        if opts.stats:
            record["entropy"] = entry.blocks["position_stats"]["entropy"]
        if opts.asked:
            record.update(asked_columns(entry.blocks["logprob_token_ids"]))
        return record


def row_request(row: Row, model: str, options: ScoreOptions) -> scoring.ScoreRequest:
    """The typed /v1/score request of one row: its text after its context, or its conversation; what
    the options ask; its asked ids. Refused, as /v1/score refuses a body, where a field's check fails."""
    return scoring.request(model, input=None if row.messages is not None else row.text,
                           context=None if row.messages is not None else row.context or None,
                           messages=row.messages, add_bos=options.add_bos, top_logprobs=options.top or None,
                           position_stats=options.stats,
                           logprob_token_ids=None if row.asked_ids is None else [row.asked_ids])
