"""A `Backend` (src/logprobe/backend.py) in numpy only, for the API tests, and a tiny tokenizer.

`FakeBackend` answers the API the way the engine does (engine/engine.py, engine/request.py,
engine/streaming.py): the same columns, offsets, stop rules, stream releases and records, but its
"model" is a deterministic function of the token ids, not a network. The log probabilities after a
sequence are the log-softmax of a pseudo-random vector seeded by its last two token ids
(`logprobs_after`), so a test can compute what any answer must hold. No torch and no transformers:
the API runs on it in milliseconds, and with torch made unimportable.

What it records of the seam: `calls` (every run / stream with its requests), `streams` (each stream's
iterator: closed, finished), `cancelled` (runs whose awaiting task was cancelled), `aborted` (ids given
to `abort`). `fail_with` makes run and stream raise (after `fail_after_steps` steps); `step_delay`
sleeps between steps (for time-outs and disconnects); `failing` and the failure counters feed /health.

`TinyTokenizer` is a byte-level tokenizer with `<s>` / `</s>`: the methods and attributes the API and
`TokenTable.build` use of a transformers tokenizer, and nothing else.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from logprobe.backend import (RequestAborted, ChoiceOutput, Delta, FinishReason, GenerationOutput,
                              GenerationRequest, ModelInfo, PositionColumns, PromptColumns, StreamEnd,
                              finished_without_forward)
from logprobe.engine.streams import Stream
from logprobe.tokens import TextAssembler, TokenTable

MODEL_SALT = 0x10C9
RESIDUAL_SALT = 0x2E51
TIED = (100, 101, 102)  # these three always share one log probability (ranks count strictly larger values)


# ---- the tokenizer -------------------------------------------------------------------------------


@dataclass
class Encoding:
    input_ids: list


class TinyTokenizer:
    """Byte-level: ids 0..255 are the bytes, 256 is `<s>` (BOS, added in front), 257 is `</s>` (EOS).
    Special tokens written in a text are read as themselves, as transformers does. Its chat template
    writes `<s>`, then `role: content</s>\\n` per message, then `assistant: `."""

    bos_token, eos_token = "<s>", "</s>"
    bos_token_id, eos_token_id = 256, 257
    pad_token = None
    pad_token_id = None
    model_max_length = 256
    TEMPLATE = ("{{ '<s>' }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '</s>\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    _SPECIAL = re.compile("(<s>|</s>)")

    def __init__(self, chat_template: str | None = TEMPLATE):
        self.chat_template = chat_template

    def __len__(self) -> int:
        return 258

    @property
    def all_special_ids(self) -> list[int]:
        return [self.bos_token_id, self.eos_token_id]

    @property
    def all_special_tokens(self) -> list[str]:
        return [self.bos_token, self.eos_token]

    @property
    def added_tokens_decoder(self) -> dict[int, str]:
        return {self.bos_token_id: self.bos_token, self.eos_token_id: self.eos_token}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.bos_token_id] if add_special_tokens else []
        for piece in self._SPECIAL.split(text):
            if piece == self.bos_token:
                ids.append(self.bos_token_id)
            elif piece == self.eos_token:
                ids.append(self.eos_token_id)
            else:
                ids.extend(piece.encode("utf-8", "surrogatepass"))
        return ids

    def __call__(self, text, add_special_tokens: bool = True) -> Encoding:
        if isinstance(text, (list, tuple)):
            return Encoding([self.encode(t, add_special_tokens) for t in text])
        return Encoding(self.encode(text, add_special_tokens))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        out, pending = [], bytearray()
        for i in ([ids] if isinstance(ids, int) else ids):
            i = int(i)
            if i < 256:
                pending.append(i)
                continue
            out.append(pending.decode("utf-8", "replace"))
            pending.clear()
            if not skip_special_tokens:
                out.append(self.bos_token if i == self.bos_token_id else self.eos_token)
        out.append(pending.decode("utf-8", "replace"))
        return "".join(out)

    def _piece(self, i: int) -> str | None:
        if 0 <= i < 256:
            return f"<0x{i:02X}>"
        return {self.bos_token_id: self.bos_token, self.eos_token_id: self.eos_token}.get(i)

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self._piece(ids)
        return [self._piece(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens):
        lookup = {self._piece(i): i for i in range(len(self))}
        if isinstance(tokens, str):
            return lookup.get(tokens)
        return [lookup.get(t) for t in tokens]

    def apply_chat_template(self, messages, tokenize: bool = False, add_generation_prompt: bool = True, **_):
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        text = self.bos_token + "".join(f"{m['role']}: {m['content']}{self.eos_token}\n" for m in messages)
        if add_generation_prompt:
            text += "assistant: "
        return self.encode(text, add_special_tokens=False) if tokenize else text


def describe(tokenizer, name: str = "test/tiny-llama", aliases=("tiny",), num_layers: int = 2, d_model: int = 64,
             context_length: int = 256, vocab_size: int | None = None) -> ModelInfo:
    """A ModelInfo for a model of these sizes on this tokenizer (what engine.describe_model reads off a
    real model, written by hand)."""
    probe = tokenizer("a", add_special_tokens=True).input_ids
    bos = tokenizer.bos_token_id
    return ModelInfo(
        name=name, aliases=list(aliases), num_layers=num_layers, d_model=d_model,
        vocab_size=len(tokenizer) if vocab_size is None else vocab_size, context_length=context_length,
        dtype="float32", bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token, bos_token_id=bos,
        eos_token_id=tokenizer.eos_token_id, adds_bos=bos is not None and bool(probe) and probe[0] == bos,
        has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
        stop_token_ids=frozenset() if tokenizer.eos_token_id is None else frozenset({tokenizer.eos_token_id}),
    )


# ---- the model: numpy functions of the token ids ------------------------------------------------


def vocab_ranks(row: np.ndarray) -> np.ndarray:
    """1 + the number of strictly larger values, for every entry of a row (engine/runner.vocab_ranks)."""
    order = np.argsort(-row, kind="stable")
    values = row[order]
    starts = np.ones(len(row), dtype=bool)
    starts[1:] = values[1:] != values[:-1]
    first = np.maximum.accumulate(np.where(starts, np.arange(len(row)), 0))
    ranks = np.empty(len(row), dtype=np.int32)
    ranks[order] = first + 1
    return ranks


def top_k(row: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k likeliest ids and their values, in descending order."""
    if k <= 0:
        return np.zeros(0, np.int64), np.zeros(0, np.float32)
    idx = np.argpartition(-row, k - 1)[:k] if k < len(row) else np.arange(len(row))
    idx = idx[np.argsort(-row[idx], kind="stable")]
    return idx.astype(np.int64), row[idx].astype(np.float32)


def filtered_scores(row: np.ndarray, params) -> np.ndarray:
    """engine/sampler.filtered_scores in numpy: temperature, then top-k and top-p at -inf."""
    scores = (row.astype(np.float64) - float(row.max())) / params.temperature
    vocab = len(scores)
    if 0 < params.top_k < vocab:
        kth = np.partition(scores, vocab - params.top_k)[vocab - params.top_k]
        scores = np.where(scores < kth, -np.inf, scores)
    if params.top_p < 1.0:
        order = np.argsort(-scores, kind="stable")
        ranked = scores[order]
        probs = np.exp(ranked - ranked[0])
        probs /= probs.sum()
        drop = np.cumsum(probs) - probs >= params.top_p
        drop[0] = False
        ranked[drop] = -np.inf
        scores = np.empty_like(scores)
        scores[order] = ranked
    return scores


def draw(scores: np.ndarray, seed: int) -> int:
    """The largest probability over an exponential random number (engine/sampler.draw), from numpy's
    generator seeded with the step's seed."""
    probs = np.exp(scores - scores.max())
    return int(np.argmax(probs / np.random.default_rng(seed).exponential(size=len(scores))))


def sample(row: np.ndarray, params, seed: int) -> int:
    """engine/sampler.sample_row in numpy: greedy below temperature 1e-5, else temperature, top-k, top-p."""
    if params.is_greedy:
        return int(np.argmax(row))
    return draw(filtered_scores(row, params), seed)


def sample_with_distribution(row: np.ndarray, params, seed: int) -> tuple[int, np.ndarray]:
    """engine/sampler.sample_with_distribution: `sample`'s token and the float32 log probabilities of the
    distribution it was drawn from (a point mass when greedy)."""
    if params.is_greedy:
        token = int(np.argmax(row))
        out = np.full(len(row), -np.inf, np.float32)
        out[token] = 0.0
        return token, out
    scores = filtered_scores(row, params)
    top = scores.max()
    return draw(scores, seed), (scores - top - np.log(np.exp(scores - top).sum())).astype(np.float32)


def ranks_of(row: np.ndarray, values: np.ndarray) -> np.ndarray:
    """1 + the number of entries of `row` strictly larger than each value."""
    ascending = np.sort(row)
    return len(row) - np.searchsorted(ascending, values, side="right") + 1


def entropy_of(row: np.ndarray) -> np.float32:
    probs = np.exp(row.astype(np.float64))
    return np.float32(-(probs * np.where(probs > 0, row, 0.0)).sum())


def top_p_set(row: np.ndarray, p: float, cap: int):
    """(ids [cap], log probabilities [cap], count, mass, truncated): engine/instruments.top_p_sets for one row."""
    cap = min(cap, len(row))
    ids, values = top_k(row, cap)
    probs = np.exp(values.astype(np.float64))
    total = np.cumsum(probs)
    count = max(1, int(((total - probs) < p).sum()))
    mass = np.float32(total[count - 1])
    return ids, values, count, mass, bool(total[count - 1] < p)


def position_rows(params, row: np.ndarray) -> dict:
    """What a request's instruments record of one distribution (not the sampled token's rank)."""
    out = {}
    if params.logprob_token_ids:
        asked = np.asarray(params.logprob_token_ids, dtype=np.int64)
        out["token_id_logprobs"] = row[asked]
        out["token_id_ranks"] = ranks_of(row, row[asked]).astype(np.int64)
    if params.position_stats:
        out["entropy"] = entropy_of(row)
    if params.top_logprobs_p is not None:
        names = ("top_p_ids", "top_p_logprobs", "top_p_counts", "top_p_mass", "top_p_truncated")
        out.update(zip(names, top_p_set(row, params.top_logprobs_p, params.max_top_p_tokens)))
    return out


def stack_rows(params, rows: list[dict], vocab: int, generated: bool) -> PositionColumns:
    """PositionColumns from per-position dicts (None for a position without a distribution); generated
    rows also have the sampled token's rank and the asked ids' processed log probabilities."""
    cols = PositionColumns(top_p=params.top_logprobs_p)
    if params.logprob_token_ids:
        cols.token_ids = np.asarray(params.logprob_token_ids, dtype=np.int64)
    num_ids, cap = len(params.logprob_token_ids), min(params.max_top_p_tokens, vocab)
    shapes = {"token_id_logprobs": (np.float32, num_ids, np.nan), "token_id_ranks": (np.int64, num_ids, 0),
              "token_id_logprobs_processed": (np.float32, num_ids, np.nan), "entropy": (np.float32, None, np.nan),
              "ranks": (np.int64, None, 0), "top_p_ids": (np.int64, cap, 0), "top_p_logprobs": (np.float32, cap, np.nan),
              "top_p_counts": (np.int64, None, 0), "top_p_mass": (np.float32, None, np.nan),
              "top_p_truncated": (bool, None, False)}
    names = set(position_rows(params, np.zeros(vocab, np.float32)))
    if generated:
        names |= {"ranks"} if params.position_stats else set()
        names |= {"token_id_logprobs_processed"} if params.records_processed and params.logprob_token_ids else set()
    for name in names:
        dtype, width, empty = shapes[name]
        column = np.full((len(rows),) if width is None else (len(rows), width), empty, dtype=dtype)
        for i, r in enumerate(rows):
            if r is not None and name in r:
                value = r[name]
                if width is not None and name.startswith("top_p_"):
                    column[i, :len(value)] = value
                else:
                    column[i] = value
        setattr(cols, name, column)
    return cols


# ---- requests in flight ----------------------------------------------------------------------------


class _Seq:
    """One choice (engine/request.Sequence, with the streaming releaser's counters)."""

    def __init__(self, index: int, request: GenerationRequest, table: TokenTable):
        params = request.params
        self.index = index
        self.stream = Stream(params.seed, index)  # the engine's counter-based streams (engine/streams.py)
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_ids: list[np.ndarray] = []
        self.top_logprobs: list[np.ndarray] = []
        self.text = TextAssembler(table, start=request.text_start)
        self.finish_reason: FinishReason | None = None
        self.num_kept: int | None = None
        self.text_end: int | None = None
        self.residual: dict[int, np.ndarray] | None = None
        self.rows: list[dict] = []  # instrument rows, one per generated token
        self.processed_logprobs: list[float] = []  # logprobs_mode "both"
        self.processed_top_logprobs: list[np.ndarray] = []
        self.sent_tokens = 0  # streaming: tokens and characters released so far
        self.sent_chars = 0
        self.sent_first = False
        self.ended = False

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def kept(self) -> int:
        return len(self.token_ids) if self.num_kept is None else self.num_kept

    def columns(self, k: int, start: int, stop: int):
        ids = np.asarray(self.token_ids[start:stop], dtype=np.int64)
        lps = np.asarray(self.logprobs[start:stop], dtype=np.float32)
        if stop > start and k:
            top_ids = np.stack(self.top_ids[start:stop])[:, :k]
            top_lps = np.stack(self.top_logprobs[start:stop])[:, :k]
        else:
            top_ids = np.zeros((stop - start, k), np.int64)
            top_lps = np.zeros((stop - start, k), np.float32)
        return ids, lps, top_ids, top_lps

    def output(self, k: int, params, vocab: int) -> ChoiceOutput:
        ids, lps, top_ids, top_lps = self.columns(k, 0, self.kept)
        text = self.text.text if self.text_end is None else self.text.text[:self.text_end]
        out = ChoiceOutput(self.index, ids, lps, top_ids, top_lps, list(self.text.offsets[:self.kept]), text,
                           self.finish_reason.value, len(self.token_ids), self.residual)
        if params.needs_position_columns:
            out.extras = stack_rows(params, self.rows[:self.kept], vocab, True)
        if params.logprobs_mode == "both" and params.logprobs is not None:
            out.processed_logprobs = np.asarray(self.processed_logprobs[:self.kept], np.float32)
            out.processed_top_logprobs = (np.stack(self.processed_top_logprobs[:self.kept])[:, :k] if self.kept and k
                                          else np.zeros((self.kept, k), np.float32))
        return out


class _Group:
    def __init__(self, request: GenerationRequest, table: TokenTable):
        self.request = request
        self.params = request.params
        self.seqs = [_Seq(j, request, table) for j in range(request.params.n)]
        self.table = table
        self.prompt_columns: PromptColumns | None = None
        self.steps = 0
        self.aborted = False

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def output(self) -> GenerationOutput:
        k = self.params.logprobs or 0
        vocab = len(self.table.strings)
        return GenerationOutput(self.request.request_id, len(self.request.prompt_ids), self.prompt_columns,
                                [s.output(k, self.params, vocab) for s in self.seqs])


@dataclass
class Call:
    kind: str  # "run" or "stream"
    requests: list[GenerationRequest]
    k: int | None = None  # the stream's top-k width


@dataclass
class StreamRecord:
    requests: list[GenerationRequest]
    finished: bool = False  # the StreamEnd went out
    closed: bool = False  # the iterator was closed (at its end, or early: the client went away)
    deltas: list[Delta] = field(default_factory=list)


# ---- the backend -----------------------------------------------------------------------------------


class FakeBackend:
    """The Backend protocol over a numpy "model". See the module's docstring."""

    def __init__(self, tokenizer, *, info: ModelInfo | None = None, step_delay: float = 0.0, salt: int = MODEL_SALT,
                 **sizes):
        self.tokenizer = tokenizer
        self.salt = salt  # another salt, another "model": different log probabilities for the same ids
        self.info = info or describe(tokenizer, **sizes)
        self.table = TokenTable.build(tokenizer, self.info.vocab_size)
        self.step_delay = step_delay
        self.fail_with: BaseException | None = None
        self.fail_after_steps = 0
        self.step_observer = None  # called with (seconds, rows) after each step, as the engine does
        self.failure_observer = None  # called with "request" when fail_with fails a request
        self.failing = False
        self.step_failures = 0
        self.request_failures = 0
        self.last_error: tuple[str, float] | None = None
        self.num_steps = 0
        self.in_flight = 0
        self.calls: list[Call] = []
        self.streams: list[StreamRecord] = []
        self.cancelled: list[list[str]] = []
        self.aborted: list[str] = []
        self._running: list[_Group] = []
        self._rows: OrderedDict = OrderedDict()

    # ---- records -----------------------------------------------------------------------------
    KEEP = 1000  # calls and streams remembered (a session-long backend sees thousands)

    def _record(self, kind: str, requests, k: int | None = None) -> None:
        self.calls.append(Call(kind, list(requests), k))
        del self.calls[:-self.KEEP]

    @property
    def requests(self) -> list[GenerationRequest]:
        """Every request that crossed the seam, in order."""
        return [r for c in self.calls for r in c.requests]

    def reset_records(self) -> None:
        self.calls.clear()
        self.streams.clear()
        self.cancelled.clear()
        self.aborted.clear()

    # ---- the model ---------------------------------------------------------------------------
    def logprobs_after(self, ids) -> np.ndarray:
        """[V] float32: the log probabilities of the token after `ids` (a function of its last two)."""
        ids = list(ids)
        return self._row(int(ids[-2]) if len(ids) >= 2 else -1, int(ids[-1]))

    def _row(self, a: int, b: int) -> np.ndarray:
        key = (a, b)
        row = self._rows.get(key)
        if row is not None:
            self._rows.move_to_end(key)
            return row
        vocab = self.info.vocab_size
        logits = np.random.default_rng([self.salt, a + 1, b + 1]).standard_normal(vocab) * 3.0
        if vocab > max(TIED):
            logits[list(TIED)] = logits[TIED[0]]
        top = logits.max()
        row = (logits - top - np.log(np.exp(logits - top).sum())).astype(np.float32)
        row.setflags(write=False)
        self._rows[key] = row
        if len(self._rows) > 64:
            self._rows.popitem(last=False)
        return row

    def residual_of(self, ids, layer: int) -> np.ndarray:
        """[len(ids), d_model] float32: position i's vector is a function of (layer, i, ids[i-1], ids[i])."""
        d = self.info.d_model
        out = np.empty((len(ids), d), dtype=np.float32)
        for i, t in enumerate(ids):
            prev = int(ids[i - 1]) if i else -1
            out[i] = np.random.default_rng([RESIDUAL_SALT, layer, i, prev + 1, int(t) + 1]).standard_normal(
                d, dtype=np.float32)
        return out

    def _prompt_columns(self, ids: list[int], k: int, full: bool, params=None) -> PromptColumns:
        num, vocab = len(ids), self.info.vocab_size
        cols = PromptColumns(np.full(num, np.nan, np.float32), np.zeros(num, np.int64), np.zeros((num, k), np.int64),
                             np.zeros((num, k), np.float32))
        if full:
            cols.full = np.full((num, vocab), np.nan, np.float32)
            cols.full_ranks = np.zeros((num, vocab), np.int32)
        own: dict = {}
        context: dict = {}
        for i in range(1, num):
            key = (ids[i - 2] if i >= 2 else -1, ids[i - 1])
            row = self._row(*key)
            if (key, ids[i]) not in own:
                value = row[ids[i]]
                own[key, ids[i]] = (value, int((row > value).sum()) + 1)
            cols.logprobs[i], cols.ranks[i] = own[key, ids[i]]
            if key not in context:
                context[key] = (top_k(row, k), vocab_ranks(row) if full else None)
            (tids, tvals), ranks = context[key]
            cols.top_ids[i], cols.top_logprobs[i] = tids, tvals
            if full:
                cols.full[i], cols.full_ranks[i] = row, ranks
        if params is not None and params.needs_position_columns:
            rows = [None] + [position_rows(params, self._row(ids[i - 2] if i >= 2 else -1, ids[i - 1]))
                             for i in range(1, num)]
            cols.extras = stack_rows(params, rows, vocab, False)
        return cols

    # ---- stepping ----------------------------------------------------------------------------
    def _step(self, group: _Group) -> int:
        """One engine step of a group: the prefill (prompt columns, first token) or one decode step.
        Returns the rows it ran."""
        params, prompt = group.params, group.request.prompt_ids
        first = group.steps == 0
        group.steps += 1
        if first and params.needs_prompt_logits:
            group.prompt_columns = self._prompt_columns(list(prompt), params.num_prompt_top,
                                                        params.prompt_logprobs == -1, params)
        rows = 0
        if first and params.max_tokens == 0:
            for seq in group.seqs:
                seq.finish_reason = FinishReason.LENGTH
                seq.text.finish()
            rows = 1
        else:
            k = params.logprobs or 0
            for seq in group.seqs:
                if seq.is_finished:
                    continue
                rows += 1
                row = self.logprobs_after(list(prompt[-2:]) + seq.token_ids[-2:])
                if params.records_processed:
                    token, processed = sample_with_distribution(row, params, seq.stream.seed(len(seq.token_ids)))
                else:
                    token, processed = sample(row, params, seq.stream.seed(len(seq.token_ids))), None
                seq.token_ids.append(token)
                numbers = processed if params.logprobs_mode == "processed" and processed is not None else row
                seq.logprobs.append(float(numbers[token]))
                if k:
                    ids, vals = top_k(row, k)
                    seq.top_ids.append(ids)
                    seq.top_logprobs.append(numbers[ids])
                if params.needs_position_columns:
                    seq.rows.append(position_rows(params, row))
                    if params.position_stats:
                        seq.rows[-1]["ranks"] = int((row > row[token]).sum()) + 1
                    if processed is not None and params.logprob_token_ids:
                        seq.rows[-1]["token_id_logprobs_processed"] = processed[list(params.logprob_token_ids)]
                if params.logprobs_mode == "both" and processed is not None:
                    seq.processed_logprobs.append(float(processed[token]))
                    if k:
                        seq.processed_top_logprobs.append(processed[ids])
                self._check_stop(seq, group)
        if group.is_finished and params.residual_layers:
            for seq in group.seqs:
                ids = list(prompt) + seq.token_ids[:seq.kept]
                seq.residual = {layer: self.residual_of(ids, layer) for layer in params.residual_layers}
        return rows

    def _check_stop(self, seq: _Seq, group: _Group) -> None:
        """engine.Engine._check_stop: stop tokens, stop strings (cut the text, keep the tokens before the
        cut), max_tokens, the context."""
        params = group.params
        token = seq.token_ids[-1]
        before = seq.text.length
        seq.text.add(token)
        if token in params.stop_token_ids:
            seq.finish_reason = FinishReason.STOP
        elif params.stop and self._cut_at_stop(seq, params.stop, before):
            seq.finish_reason = FinishReason.STOP
        elif len(seq.token_ids) >= params.max_tokens:
            seq.finish_reason = FinishReason.LENGTH
        elif len(group.request.prompt_ids) + len(seq.token_ids) >= self.info.context_length:
            seq.finish_reason = FinishReason.LENGTH
        if seq.is_finished:
            seq.text.finish()

    @staticmethod
    def _cut_at_stop(seq: _Seq, stops: list[str], before: int) -> bool:
        start = seq.text.offsets[0]
        text = seq.text.text
        window = max(0, before - start - max(len(s) for s in stops) + 1)
        hits = [p for p in (text.find(s, window) for s in stops) if p >= 0]
        if not hits:
            return False
        cut = min(hits)
        seq.text_end = cut
        seq.num_kept = sum(1 for off in seq.text.offsets if off < start + cut)
        return True

    def _fail_now(self, steps_done: int) -> None:
        if self.fail_with is not None and steps_done >= self.fail_after_steps:
            exc = self.fail_with
            self.request_failures += 1
            self.last_error = (type(exc).__name__, time.time())
            if self.failure_observer is not None:
                self.failure_observer("request")
            raise exc

    async def _drive(self, groups: list[_Group]) -> None:
        """Step every group until all have finished, sleeping `step_delay` between steps (a cancellation
        lands there)."""
        steps = 0
        while True:
            self._fail_now(steps)
            live = [g for g in groups if not g.is_finished]
            if not live:
                return
            t0, rows = time.perf_counter(), 0
            for g in live:
                if g.aborted:
                    raise RequestAborted(f"request {g.request.request_id} was aborted")
                rows += self._step(g)
            steps += 1
            self.num_steps += 1
            if self.step_observer is not None:
                self.step_observer(time.perf_counter() - t0, rows)
            await asyncio.sleep(self.step_delay)

    # ---- the Backend protocol ----------------------------------------------------------------
    async def run(self, requests: list[GenerationRequest]) -> list[GenerationOutput]:
        self._record("run", requests)
        groups = {i: _Group(r, self.table) for i, r in enumerate(requests) if r.params.needs_forward}
        self._running += groups.values()
        self.in_flight += len(groups)
        try:
            if groups:
                await self._drive(list(groups.values()))
            else:
                self._fail_now(0)
        except asyncio.CancelledError:
            self.cancelled.append([r.request_id for r in requests])
            raise
        finally:
            self.in_flight -= len(groups)
            for g in groups.values():
                self._running.remove(g)
        return [groups[i].output() if i in groups else finished_without_forward(r) for i, r in enumerate(requests)]

    async def stream(self, requests: list[GenerationRequest], k: int):
        """Lists of Delta after each step that released something, then a StreamEnd; closing the
        iterator early ends the requests (recorded in `streams`)."""
        self._record("stream", requests, k)
        record = StreamRecord(list(requests))
        self.streams.append(record)
        del self.streams[:-self.KEEP]
        groups = [_Group(r, self.table) for r in requests]
        holds = [max((len(s) for s in r.params.stop), default=1) - 1 for r in requests]
        self._running += groups
        self.in_flight += len(groups)
        try:
            steps = 0
            while True:
                self._fail_now(steps)
                live = [(i, g) for i, g in enumerate(groups) if not g.is_finished]
                if not live:
                    break
                t0, rows, released = time.perf_counter(), 0, []
                for i, g in live:
                    if g.aborted:
                        raise RequestAborted(f"request {g.request.request_id} was aborted")
                    rows += self._step(g)
                    deltas = [d for seq in g.seqs for d in self._release(i, g, seq, k, holds[i])]
                    if deltas:
                        released.append(deltas)
                steps += 1
                self.num_steps += 1
                if self.step_observer is not None:
                    self.step_observer(time.perf_counter() - t0, rows)
                for deltas in released:
                    record.deltas += deltas
                    yield deltas
                await asyncio.sleep(self.step_delay)
            record.finished = True
            yield StreamEnd([len(g.request.prompt_ids) for g in groups],
                            [sum(len(s.token_ids) for s in g.seqs) for g in groups])
        finally:
            record.closed = True
            self.in_flight -= len(groups)
            for g in groups:
                self._running.remove(g)

    def _release(self, group_index: int, group: _Group, seq: _Seq, k: int, hold: int) -> list[Delta]:
        """The choice's new deltas after a step, one per released token (engine/streaming.Releaser, which
        sends them together): while stop strings are set, the last `hold` characters wait; the delta with
        the finish_reason is the choice's last."""
        if seq.ended:
            return []
        text = seq.text.text
        start = seq.text.offsets[0] if seq.text.offsets else 0
        count = len(seq.token_ids)
        if seq.is_finished:
            upto = seq.kept
            chars = len(text) if seq.text_end is None else seq.text_end
        else:
            upto, chars = seq.sent_tokens, len(text) - hold

        def end_of(i):  # where token i's text ends in the generated text
            end = (seq.text.offsets[i + 1] if i + 1 < count else start + len(text)) - start
            return min(end, chars) if seq.is_finished else end

        if not seq.is_finished:
            # A token goes out once its text is safe and, while stop strings are set, once it starts before
            # the held-back characters: a stop string found later cuts at or after them, and drops the
            # tokens that start at the cut, an empty one (a special token, an unfinished character)
            # included. (The engine's Releaser checks only the end, so it can send such a token.)
            stops = bool(group.params.stop)
            while upto < count and end_of(upto) <= chars and (
                    not stops or seq.text.offsets[upto] - start < chars):
                upto += 1
        deltas = []
        for i in range(seq.sent_tokens, upto):
            last = seq.is_finished and i == upto - 1
            end = chars if last else end_of(i)
            deltas.append(self._delta(group_index, group, seq, k, i, i + 1, text[seq.sent_chars:end],
                                      seq.finish_reason.value if last else None))
            seq.sent_chars = end
        seq.sent_tokens = upto
        if seq.is_finished and not deltas:  # nothing left but the ending (and any text the last token finished)
            deltas.append(self._delta(group_index, group, seq, k, upto, upto, text[seq.sent_chars:chars],
                                      seq.finish_reason.value))
            seq.sent_chars = chars
        elif not deltas and not seq.sent_first:  # the choice's first delta goes out after its first step
            deltas.append(self._delta(group_index, group, seq, k, upto, upto, "", None))
        seq.ended = seq.is_finished
        return deltas

    def _delta(self, group_index, group, seq, k, start, stop, text, finish_reason) -> Delta:
        ids, lps, top_ids, top_lps = seq.columns(k, start, stop)
        first = not seq.sent_first
        seq.sent_first = True
        return Delta(group_index, seq.index, first, text, ids, lps, top_ids, top_lps,
                     list(seq.text.offsets[start:stop]), finish_reason, group.prompt_columns if first else None)

    def abort(self, request_id: str) -> None:
        """The requests with this id stop before their next step; their run or stream raises
        RequestAborted, as the engine's do."""
        self.aborted.append(request_id)
        for g in self._running:
            if g.request.request_id == request_id:
                g.aborted = True

    def generated(self, request_id: str) -> int:
        """Tokens generated so far by the running requests with this id (the engine's `generated`)."""
        return sum(len(seq.token_ids) for g in self._running if g.request.request_id == request_id for seq in g.seqs)

    def stats(self) -> dict:
        out = {"in_flight": self.in_flight, "steps": self.num_steps, "kv_cache_bytes": 0, "failing": self.failing,
               "step_failures": self.step_failures, "request_failures": self.request_failures}
        if self.last_error is not None:
            out["last_error"] = {"type": self.last_error[0], "at": round(self.last_error[1], 3)}
        return out
