"""Scoring rows on running servers: /v1/score over HTTP, several requests in flight.

Rows go out in requests of `batch_rows`, spread over the servers in turn, at most `concurrency` at
once, through the one client of /v1/score (client/http.py: 429, 5xx and a dropped connection tried
again, waiting at least what Retry-After says; a refusal a retry cannot fix ends the job with the
server's message; a connection refused before any server answered ends it at once, naming the
address). Each request's rows count as done when it comes back. Token strings come from the server
too (a one-token /v1/score per unseen id), so they are the ones the in-process path gives.
"""

from __future__ import annotations

import asyncio

from ..client.http import ScoreClient, ServerError
from .columns import ScoreOptions, asked_columns, empty_record, error_record, summary, to_table
from .io import DatasetError, Prepared, Row
from .job import run_sync


class RemoteRefused(DatasetError):
    """A server refused a request for a reason that a retry cannot fix."""

    def __init__(self, message: str, code: str | None = None, status: int | None = None):
        super().__init__(message)
        self.code = code
        self.status = status


class RemoteScorer:
    """Scores rows on one or more running logprobe servers (`urls`)."""

    def __init__(self, urls: list[str], api_key: str | None = None, model: str | None = None, concurrency: int = 8,
                 options: ScoreOptions = ScoreOptions(), batch_rows: int = 16, max_attempts: int = 8,
                 transport=None):
        """`batch_rows`: rows per request (at most the server's max_prompts); `max_attempts`: tries of
        a request that meets 429/503/5xx or a dropped connection; `model`: None for the server's first;
        `transport`: httpx's (tests)."""
        if not urls:
            raise DatasetError("no server URL given")
        self.urls = list(urls)
        self.api_key = api_key
        self.model_name = model
        self.concurrency = max(1, concurrency)
        self.options = options
        self.batch_rows = max(1, batch_rows)
        self.max_attempts = max_attempts
        self._strings: dict[int, str] = {}
        self._served = model  # the model the servers were asked for, once known
        self._transport = transport

    def prepare(self, rows: list[Row]) -> list:
        """Nothing is checked before scoring: the server checks each request."""
        return [Prepared(row) for row in rows]

    def refuse_invalid(self, prepared: list) -> None:
        return None

    def close(self) -> None:
        return None

    def score(self, rows: list[Row]):
        """A pyarrow Table of the rows' scores, in the order given."""
        return to_table(run_sync(self.run(self.prepare(rows))), self.options)

    async def run(self, prepared: list, on_rows=None) -> list[dict]:
        """Records of prepared rows, in the given order; `on_rows(rows, tokens)` as each request's rows
        come back."""
        rows = [p.row for p in prepared]
        todo = sorted((r for r in rows if r.text and r.messages is None), key=lambda r: (r.context or "", len(r.text)))
        batches = [todo[i:i + self.batch_rows] for i in range(0, len(todo), self.batch_rows)]
        talks = [r for r in rows if r.messages is not None]  # batch_rows conversations a request (`conversations`)
        batches += [talks[i:i + self.batch_rows] for i in range(0, len(talks), self.batch_rows)]
        gate = asyncio.Semaphore(self.concurrency)
        async with ScoreClient(self.urls, self.api_key, self._served, self.max_attempts,
                               transport=self._transport) as client:
            async def one(batch):
                async with gate:
                    records = await self._score_batch(client, batch)
                if on_rows is not None:
                    on_rows(len(batch), sum(r.get("num_tokens") or 0 for r in records))
                return records

            try:
                results = await asyncio.gather(*(one(b) for b in batches))
                records = {r.index: rec for batch, recs in zip(batches, results) for r, rec in zip(batch, recs)}
                if self.options.top:
                    await self._name_tops(client, records.values())
            except ServerError as exc:
                raise (RemoteRefused(exc.message, exc.code) if exc.status is not None
                       else DatasetError(exc.message)) from None
            self._served = client.model
        empty = [row for row in rows if not row.scored]
        for row in empty:
            records[row.index] = empty_record(row.id, self.options)
        if empty and on_rows is not None:
            on_rows(len(empty), 0)
        return [records[r.index] for r in rows]

    # ---- requests -----------------------------------------------------------------------------
    async def _score_batch(self, client, batch: list[Row]) -> list[dict]:
        body = {"input": [r.text for r in batch], "add_bos": self.options.add_bos,
                "return_tokens_as_token_ids": bool(self.options.top)}
        if any(r.context for r in batch):
            body["context"] = [r.context or "" for r in batch]
        if self.options.top:
            body["top_logprobs"] = self.options.top
        if self.options.stats:
            body["position_stats"] = True
        if self.options.asked:
            body["logprob_token_ids"] = [r.asked_ids for r in batch]
        if batch[0].messages is not None:  # one conversation in `messages`, several in `conversations`
            del body["input"]
            if len(batch) == 1:
                body["messages"] = batch[0].messages
            else:
                body["conversations"] = [r.messages for r in batch]
        try:
            data = (await client.score(body))["data"]
        except ServerError as exc:
            # a row's own fault (its length; a conversation's or its ids' shape) is its error, with --skip-invalid
            # (a batch of conversations refused: one of them, each its own template's rendering)
            own = exc.code == "context_length_exceeded" or (exc.status == 400 and (
                len(batch) == 1 or batch[0].messages is not None))
            if not (self.options.skip_invalid and own):
                raise
            if len(batch) == 1:
                return [error_record(batch[0].id, exc.message)]
            # Find the rows at fault: each alone
            return [rec for r in batch for rec in await self._score_batch(client, [r])]
        return [self._record(r, entry) for r, entry in zip(batch, data)]

    async def _name_tops(self, client, records) -> None:
        """Token strings of the top ids: the server's own, asked once per id (a one-token score each)."""
        records = [r for r in records if "top_ids" in r]
        wanted = {i for r in records for row in r["top_ids"] if row for i in row}
        wanted.update(i for r in records if "tokens" in r for i in r["token_ids"])
        unseen = sorted(wanted - set(self._strings))
        for start in range(0, len(unseen), 128):
            ids = unseen[start:start + 128]
            data = (await client.score({"input": [[i] for i in ids], "add_bos": False}))["data"]
            self._strings.update((i, entry["tokens"][0]) for i, entry in zip(ids, data))
        for record in records:
            record["top_tokens"] = [None if row is None else [self._strings[i] for i in row]
                                    for row in record["top_ids"]]
        for record in records:
            if "tokens" in record:
                record["tokens"] = [self._strings.get(i, t) for i, t in zip(record["token_ids"], record["tokens"])]

    def _record(self, row: Row, entry: dict) -> dict:
        record = summary(row.id, entry["num_tokens"], entry["logprob"], entry["mean_logprob"], entry["perplexity"])
        if self.options.tokens:
            record.update(tokens=entry["tokens"], token_ids=entry["token_ids"],
                          token_logprobs=entry["token_logprobs"], ranks=entry["token_ranks"])
        if self.options.top:
            ids, values = [], []
            for position, alternatives in enumerate(entry["top_logprobs"]):
                if alternatives is None:
                    ids.append(None)
                    values.append(None)
                    continue
                pairs = _top_of(alternatives, self.options.top)
                ids.append([i for i, _ in pairs])
                values.append([v for _, v in pairs])
            record.update(top_ids=ids, top_logprobs=values)
        if self.options.stats:
            record["entropy"] = entry["position_stats"]["entropy"]
        if self.options.asked:
            record.update(asked_columns(entry["logprob_token_ids"]))
        return record


def _top_of(alternatives: dict, k: int) -> list[tuple[int, float]]:
    """The k likeliest (id, log probability) in order, from a /v1/score top_logprobs map keyed
    `token_id:N`: the token itself first, then the k likeliest without it (k + 1 entries when it is not
    among them, k when it is; then it goes before the others of its value)."""
    pairs = [(int(key.split(":", 1)[1]), value) for key, value in alternatives.items()]
    token, others = pairs[0], pairs[1:]
    if len(pairs) == k + 1:
        return others
    at = sum(1 for _, value in others if value > token[1])
    return others[:at] + [token] + others[at:]
