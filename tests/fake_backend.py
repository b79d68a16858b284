"""A `Backend` (src/logprobe/backend/) in numpy only, for the API tests, and a tiny tokenizer.

`FakeBackend` fakes the model and nothing else. Its "model" is a deterministic function of the token
ids, not a network: the log probabilities after a sequence are the log-softmax of a pseudo-random vector
seeded by its last two token ids (`logprobs_after`), so a test can compute what any answer must hold;
`pick_rows` chooses tokens from them in numpy as the engine's sampler does on the device. Everything
after that is the engine's own torch-free code: its request state (engine/host/request.py), the output
processor's records and stop rules (engine/host/output_processor.py), its stream releases
(engine/host/streaming.py) and its activation captures (engine/host/captures.py). Its driver is simpler than the
engine's loop: each call steps its own groups, all of them every step, a prompt in one step (the
scheduler's decisions are tested on their own, tests/unit/test_scheduler.py). No torch and no
transformers: the API runs on it in milliseconds, and with torch made unimportable.

What it records of the seam: `calls` (every run / stream with its requests), `streams` (each stream's
iterator: closed, finished), `cancelled` (runs whose awaiting task was cancelled), `aborted` (ids given
to `abort`). `fail_with` makes run and stream raise (after `fail_after_steps` steps); `step_delay`
sleeps between steps (for time-outs and disconnects); `gate`, if set, is awaited before a run's or
stream's first step (a test holds work there, tests/batch_helpers.py `Gate`); `failing` and the
failure counters feed /health.

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

from logprobe.backend import (RequestAborted, RequestConflict, Delta, GenerationOutput, GenerationRequest, ModelInfo,
                              PositionColumns, PromptColumns, StreamEnd, finished_without_forward, run_to_end)
from logprobe.engine.host.captures import capture_residual
from logprobe.engine.host.output_processor import OutputProcessor
from logprobe.engine.host.picks import Pick
from logprobe.engine.host.request import SequenceGroup
from logprobe.engine.host.streaming import release_all, releasers_of
from logprobe.engine.host.tree import Children, TreeGroup, group_for
from logprobe.tokens import TokenTable

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
    """1 + the number of strictly larger values, for every entry of a row (engine/prompt_columns.vocab_ranks)."""
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


def position_rows(params, row: np.ndarray, position: int | None = None) -> dict:
    """What a request's instruments record of one distribution (not the sampled token's rank); a prompt
    `position`'s own asked ids where the request has them, padded with id 0 to the widest (as the engine)."""
    out = {}
    asked = None
    if params.logprob_token_ids:
        asked = np.asarray(params.logprob_token_ids, dtype=np.int64)
    elif params.position_token_ids and position is not None:
        asked = np.zeros(max(1, max(len(x) for x in params.position_token_ids)), dtype=np.int64)
        own = params.position_token_ids[position] if position < len(params.position_token_ids) else ()
        asked[:len(own)] = own
    if asked is not None:
        out["token_id_logprobs"] = row[asked]
        out["token_id_ranks"] = ranks_of(row, row[asked]).astype(np.int64)
    if params.position_stats:
        out["entropy"] = entropy_of(row)
    if params.top_logprobs_p is not None:
        names = ("top_p_ids", "top_p_logprobs", "top_p_counts", "top_p_mass", "top_p_truncated")
        out.update(zip(names, top_p_set(row, params.top_logprobs_p, params.max_top_p_tokens)))
    return out


def stack_rows(params, rows: list[dict | None], vocab: int) -> PositionColumns:
    """Prompt PositionColumns from per-position dicts (None for a position without a distribution)."""
    cols = PositionColumns(top_p=params.top_logprobs_p)
    if params.logprob_token_ids:
        cols.token_ids = np.asarray(params.logprob_token_ids, dtype=np.int64)
    num_ids = len(params.logprob_token_ids) or max((len(x) for x in params.position_token_ids), default=1) or 1
    cap = min(params.max_top_p_tokens, vocab)
    shapes = {"token_id_logprobs": (np.float32, num_ids, np.nan), "token_id_ranks": (np.int64, num_ids, 0),
              "entropy": (np.float32, None, np.nan), "top_p_ids": (np.int64, cap, 0),
              "top_p_logprobs": (np.float32, cap, np.nan), "top_p_counts": (np.int64, None, 0),
              "top_p_mass": (np.float32, None, np.nan), "top_p_truncated": (bool, None, False)}
    for name in position_rows(params, np.zeros(vocab, np.float32), 0):
        dtype, width, empty = shapes[name]
        column = np.full((len(rows),) if width is None else (len(rows), width), empty, dtype=dtype)
        for i, r in enumerate(rows):
            if r is not None:
                if width is not None and name.startswith("top_p_"):
                    column[i, :len(r[name])] = r[name]
                else:
                    column[i] = r[name]
        setattr(cols, name, column)
    return cols


def pick_rows(rows: list[np.ndarray], params, seeds: list[int], k: int) -> Pick:
    """A group's rows after a step, in numpy: what the engine's device side hands its output processor
    (sampler.pick for a plain request, instruments.pick_with_instruments for one that asked): each row's
    token, its log probability and top-k (of the drawn-from distribution where `logprobs_mode` asks),
    and the instrument columns."""
    tokens, logprobs, top_ids, top_logprobs, processed_logprobs, processed_tops = [], [], [], [], [], []
    columns: dict[str, list] = {}
    for row, seed in zip(rows, seeds):
        if params.records_processed:
            token, processed = sample_with_distribution(row, params, seed)
        else:
            token, processed = sample(row, params, seed), None
        numbers = processed if params.logprobs_mode == "processed" and processed is not None else row
        ids, _ = top_k(row, k)
        tokens.append(token)
        logprobs.append(numbers[token])
        top_ids.append(ids)
        top_logprobs.append(numbers[ids])
        if params.needs_position_columns:
            found = position_rows(params, row)
            if params.position_stats:
                found["ranks"] = int((row > row[token]).sum()) + 1
            if processed is not None and params.logprob_token_ids:
                found["token_id_logprobs_processed"] = processed[list(params.logprob_token_ids)]
            for name, value in found.items():
                columns.setdefault(name, []).append(value)
        if params.logprobs_mode == "both" and processed is not None:
            processed_logprobs.append(processed[token])
            processed_tops.append(processed[ids])
    both = bool(processed_logprobs)
    return Pick(np.asarray(tokens, np.int64), np.asarray(logprobs, np.float32),
                np.stack(top_ids).astype(np.int64), np.stack(top_logprobs).astype(np.float32),
                np.asarray(processed_logprobs, np.float32) if both else None,
                np.stack(processed_tops).astype(np.float32) if both else None,
                {name: np.asarray(values) for name, values in columns.items()})


def tree_children(rows: list[np.ndarray], params, shape) -> Children:
    """engine/tree_passes.children_of in numpy (temperature, top-k and top-p; no steering): each row's
    `branches` likeliest tokens of the processed distribution that may be drawn, cut by `branch_p`."""
    k = min(shape.branches, len(rows[0]))
    counts, ids, raws, processed, ranks, entropies = [], [], [], [], [], []
    for row in rows:
        if params.is_greedy:
            dist = np.full(len(row), -np.inf, np.float32)
            dist[int(np.argmax(row))] = 0.0
        else:
            scores = filtered_scores(row, params)
            top = scores.max()
            dist = (scores - top - np.log(np.exp(scores - top).sum())).astype(np.float32)
        chosen, values = top_k(dist, k)
        keep = np.isfinite(values)
        if shape.branch_p is not None:
            probs = np.exp(values.astype(np.float64))
            keep &= (np.cumsum(probs) - probs) < shape.branch_p
        counts.append(int(keep.sum()))
        ids.append(chosen)
        raws.append(row[chosen])
        processed.append(values)
        ranks.append(ranks_of(row, row[chosen]))
        entropies.append(entropy_of(row))
    return Children(np.asarray(counts, np.int64), np.stack(ids), np.stack(raws).astype(np.float32),
                    np.stack(processed), np.stack(ranks).astype(np.int64), np.asarray(entropies, np.float32))


# ---- records ---------------------------------------------------------------------------------------


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
        self.gate = None  # an async callable each run and stream awaits before its first step (a test's hold)
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
        self.outputs = OutputProcessor(self.info.context_length)  # the engine's own
        self._running: list[SequenceGroup] = []
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
            rows = [None] + [position_rows(params, self._row(ids[i - 2] if i >= 2 else -1, ids[i - 1]), i)
                             for i in range(1, num)]
            cols.extras = stack_rows(params, rows, vocab)
        return cols

    def residual_stream(self, ids: list[int], layers: list[int], edits=None) -> dict[int, np.ndarray]:
        """The runner's method of that name (engine/host/captures.py reads activations through it)."""
        return {layer: self.residual_of(ids, layer) for layer in layers}

    # ---- stepping: the model's part, then the engine's output processor ----------------------
    def _step(self, group: SequenceGroup) -> int:
        """One engine step of a group: the prefill (prompt columns, first token) or one decode step.
        Returns the rows it ran."""
        params, prompt = group.params, group.prompt_ids
        if isinstance(group, TreeGroup):  # a level of a token tree: the frontier's rows, the engine's growth
            rows = [self.logprobs_after(prompt + (group.path(node) if node >= 0 else [])) for node in group.frontier]
            group.grow(tree_children(rows, params, group.shape))
            return len(rows)
        num_rows = len(group.active_rows)
        if not group.active_rows:  # the prefill
            group.num_computed_tokens = group.num_prompt_tokens
            if params.needs_prompt_logits:
                group.prompt_columns = self._prompt_columns(list(prompt), params.num_prompt_top,
                                                            params.prompt_logprobs == -1, params)
            if params.max_tokens == 0:
                self.outputs.finish_prompt_only(group)
                num_rows = 1
            else:
                self.outputs.start_decoding(group)
                num_rows = len(group.active_rows)
        if group.active_rows:
            seqs = [group.sequences[i] for i in group.active_rows]
            rows = [self.logprobs_after(list(prompt[-2:]) + seq.token_ids[-2:]) for seq in seqs]
            self.outputs.record(group, pick_rows(rows, params, [seq.next_seed() for seq in seqs],
                                                 params.logprobs or 0))
        if group.is_finished and params.residual_layers:
            capture_residual(self, group)
        return num_rows

    def _fail_now(self, steps_done: int) -> None:
        if self.fail_with is not None and steps_done >= self.fail_after_steps:
            exc = self.fail_with
            if not isinstance(exc, RequestConflict):  # the request's own error is no failure (engine/core.py)
                self.request_failures += 1
                self.last_error = (type(exc).__name__, time.time())
                if self.failure_observer is not None:
                    self.failure_observer("request")
            raise exc

    def _step_all(self, groups: list[SequenceGroup], steps_done: int, on_step=None) -> bool:
        """One step of every group not yet finished (False when none is left); `on_step(i)`, if given,
        runs after group i's step."""
        self._fail_now(steps_done)
        live = [(i, g) for i, g in enumerate(groups) if not g.is_finished]
        if not live:
            return False
        t0, rows = time.perf_counter(), 0
        for i, g in live:
            if g.is_aborted:
                raise RequestAborted(f"request {g.request_id} was aborted")
            rows += self._step(g)
            if on_step is not None:
                on_step(i)
        self.num_steps += 1
        if self.step_observer is not None:
            self.step_observer(time.perf_counter() - t0, rows)
        return True

    # ---- the Backend protocol ----------------------------------------------------------------
    async def run(self, requests: list[GenerationRequest]) -> list[GenerationOutput]:
        """The requests' outputs: the stream without deltas, drained (as the engine's run)."""
        return await run_to_end(self, requests)

    async def stream(self, requests: list[GenerationRequest], k: int | None):
        """Lists of Delta after each step that released something (the engine's releasers), then a
        StreamEnd; closing the iterator early ends the requests (recorded in `streams`). With `k` None
        (a request answered whole, recorded as a "run" call): no deltas, the outputs on the StreamEnd,
        a request that needs no forward pass answered without a step, and a cancellation recorded in
        `cancelled`."""
        whole = k is None
        if whole:
            self._record("run", requests)
        else:
            self._record("stream", requests, k)
        record = None
        if whole:
            groups = {i: group_for(r, self.table) for i, r in enumerate(requests) if r.params.needs_forward}
            releasers = None
        else:
            record = StreamRecord(list(requests))
            self.streams.append(record)
            del self.streams[:-self.KEEP]
            groups = {i: SequenceGroup.from_request(r, self.table) for i, r in enumerate(requests)}
            releasers = [releasers_of(g, k) for g in groups.values()]
        live = list(groups.values())
        released: list[list[Delta]] = []

        def on_step(i: int) -> None:
            deltas = release_all(releasers[i], i)
            if deltas:
                released.append(deltas)

        self._running += live
        self.in_flight += len(live)
        try:
            if self.gate is not None:
                await self.gate()
            steps = 0
            while self._step_all(live, steps, None if whole else on_step):  # a cancellation lands in the sleep
                steps += 1
                for deltas in released:
                    record.deltas += deltas
                    yield deltas
                released.clear()
                await asyncio.sleep(self.step_delay)
            if whole:
                yield StreamEnd.of([groups[i].output() if i in groups else finished_without_forward(r)
                                    for i, r in enumerate(requests)])
                return
            record.finished = True
            yield StreamEnd([g.num_prompt_tokens for g in live], [sum(len(s.token_ids) for s in g.sequences) for g in live],
                            [g.num_cached_tokens for g in live])
        except asyncio.CancelledError:
            if whole:
                self.cancelled.append([r.request_id for r in requests])
            raise
        finally:
            if record is not None:
                record.closed = True
            self.in_flight -= len(live)
            for g in live:
                self._running.remove(g)

    def abort(self, request_id: str) -> None:
        """The requests with this id stop before their next step; their run or stream raises
        RequestAborted, as the engine's do."""
        self.aborted.append(request_id)
        for g in self._running:
            if g.request_id == request_id:
                g.is_aborted = True

    steps_here = True

    def observe(self, on_step, on_failure) -> None:
        self.step_observer, self.failure_observer = on_step, on_failure

    def collector(self) -> None:
        return None

    def generated(self, request_id: str) -> int:
        """Tokens generated so far by the running requests with this id (the engine's `generated`)."""
        return sum(len(seq.token_ids) for g in self._running if g.request_id == request_id for seq in g.sequences)

    def stats(self) -> dict:
        out = {"in_flight": self.in_flight, "steps": self.num_steps, "kv_cache_bytes": 0, "failing": self.failing,
               "step_failures": self.step_failures, "request_failures": self.request_failures}
        if self.last_error is not None:
            out["last_error"] = {"type": self.last_error[0], "at": round(self.last_error[1], 3)}
        return out
