"""The engine's KV cache manager (engine/host/kv_manager.py) and the runner's memory that carries out its
decisions (engine/runners/kv_cache.py), together, without a model: random sequences of what an engine's
steps do (prompts' choices joining, decode steps, choices and groups ending, idle shrinks), every
position's key written as the id of the token it holds, so that after every operation each row's memory
must read back exactly its own tokens, and every key kept in the prefix cache exactly the tokens it names.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from logprobe.engine.host.kv_manager import Alloc, KVManager, Move
from logprobe.engine.runners.kv_cache import KVMemory

FIRST = 4  # the first class's capacity: rows cross classes 4, 8, 16, 32, 64 within a few steps
MAX_LEN = 64


class Index:
    """The prefix index as the manager sees it (enabled, covers) and the runner fills it (keep)."""

    enabled = True

    def __init__(self):
        self.kept: list[list[int]] = []

    def covers(self, ids) -> bool:
        return any(kept[:len(ids)] == list(ids) for kept in self.kept)

    def keep(self, ids, keys, values):
        assert keys[0][0, :, 0].tolist() == ids == values[0][0, :, 0].tolist()  # the row's own tokens
        self.kept.append(list(ids))


class Group(SimpleNamespace):
    """What the manager reads of a scheduler's group, one object one group (as SequenceGroup)."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__


def group(uid: int, length: int, n: int, interventions=None):
    """A group of `n` choices whose prompt's tokens (ids uid * 10000 + position) fill `length` positions."""
    return Group(request_id=f"g{uid}", uid=uid, prompt_ids=[uid * 10000 + p for p in range(length)],
                           num_prompt_tokens=length, active_rows=list(range(n)), error=None,
                           params=SimpleNamespace(interventions=interventions),
                           sequences=[SimpleNamespace(token_ids=[]) for _ in range(n)])


def tokens_of(row) -> list[int]:
    g = row.group
    return g.prompt_ids + g.sequences[row.seq_index].token_ids


def pick(row) -> None:
    """The row's next token (not run yet): id uid * 10000 + (choice + 1) * 1000 + its position."""
    g = row.group
    seq = g.sequences[row.seq_index]
    seq.token_ids.append(g.uid * 10000 + (row.seq_index + 1) * 1000 + g.num_prompt_tokens + len(seq.token_ids))


def check(kv: KVManager, memory: KVMemory, live: list) -> None:
    assert kv.is_consistent(live) and memory.matches(kv)
    for row in kv.rows:
        slab = memory.slabs[row.slab]
        want = tokens_of(row)[:row.length]
        assert slab.keys[0][row.slot, 0, :row.length, 0].tolist() == want
        assert slab.values[1][row.slot, 0, :row.length, 0].tolist() == want
        assert row.slab <= max(FIRST, 2 * row.length)  # a row's class is at most twice its length


def write(memory: KVMemory, row, start: int = 0, stop: int | None = None) -> None:
    """Positions start..stop-1 (stop: the row's length) of the row's tokens into its slot (a prompt, or a
    decode step's one position)."""
    stop = row.length if stop is None else stop
    ids = torch.tensor(tokens_of(row)[start:stop], dtype=torch.float32)[None, :, None]
    if start == 0:  # a prompt's: as the runner's `expand` writes it
        memory.write(row.slab, row.slot, [ids] * memory.num_layers, [ids] * memory.num_layers)
        return
    slab = memory.slabs[row.slab]
    with torch.inference_mode():  # as a decode pass writes its position
        for layer in range(memory.num_layers):
            slab.keys[layer][row.slot, :, start:stop] = ids
            slab.values[layer][row.slot, :, start:stop] = ids


def decode_step(kv: KVManager, memory: KVMemory, keep=None) -> list:
    """What an engine's decode step does to the cache: the manager's room made (its operations carried
    out, returned), each row's last token written at its next position, the positions counted, and each
    row's next token picked."""
    ops = kv.make_room()
    memory.apply(ops, keep)
    for row in kv.rows:
        write(memory, row, row.length, row.length + 1)
    kv.advance()
    for row in kv.rows:
        pick(row)
    return ops


@pytest.mark.parametrize("seed", range(6))
def test_random_steps_keep_every_rows_tokens_where_the_manager_says(seed):
    rng = random.Random(seed)
    index = Index()
    kv = KVManager(MAX_LEN, slots=1, capacity=FIRST, prefix_index=index)
    memory = KVMemory(2, 1, 1, torch.float32, torch.device("cpu"))
    memory.reset(kv)
    live, uid, seen = [], 0, {"moves": 0, "grown": 0, "kept": 0, "classes": 0}
    for _ in range(400):
        action = rng.choices(["join", "decode", "select", "release", "shrink"], [3, 8, 1, 2, 1])[0]
        if action == "join" and kv.num_rows < 24:
            uid += 1
            g = group(uid, rng.randint(1, 40), rng.randint(1, 3), interventions=[1] if uid % 7 == 0 else None)
            rows, ops = kv.expand(g, g.num_prompt_tokens)
            memory.apply(ops, index.keep)
            for row in rows:
                write(memory, row)
                pick(row)
            live.append(g)
        elif action == "decode" and kv.rows:
            ops = decode_step(kv, memory, index.keep)
            seen["moves"] += sum(isinstance(op, Move) and op.source != op.capacity for op in ops)
            seen["grown"] += sum(isinstance(op, Alloc) and op.keep > 0 for op in ops)
            seen["classes"] = max(seen["classes"], sum(1 for c in kv.classes.values() if c.rows))
            for g in [g for g in live if any(r.length >= MAX_LEN - 2 for r in kv.rows_of(g))]:  # at the context
                memory.apply(kv.release(g), index.keep)
                live.remove(g)
        elif action == "select":
            several = [g for g in live if len(kv.rows_of(g)) > 1]
            if several:
                g = rng.choice(several)
                places = range(len(kv.rows_of(g)))
                keep = sorted(rng.sample(places, rng.randint(1, len(places) - 1)))
                memory.apply(kv.select(g, keep), index.keep)
        elif action == "release" and live:
            g = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.2:
                g.error = RuntimeError("failed")  # a failed group leaves nothing in the prefix cache
            kept = len(index.kept)
            memory.apply(kv.release(g), index.keep)
            if g.error is not None or g.params.interventions:
                assert len(index.kept) == kept
            seen["kept"] += len(index.kept) - kept
        elif action == "shrink":
            memory.apply(kv.shrink(), index.keep)
        check(kv, memory, live)
    for g in live:
        memory.apply(kv.release(g), index.keep)
    memory.apply(kv.shrink(), index.keep)
    check(kv, memory, [])
    assert [(c, k.num_slots) for c, k in kv.classes.items()] == [(FIRST, 1)] and not kv.held
    assert memory.nbytes == 2 * 2 * 1 * FIRST * 1 * 4  # back to the first class's one slot
    # the sequence went through what it is there to test
    assert seen["moves"] >= 20 and seen["grown"] >= 5 and seen["kept"] >= 5 and seen["classes"] >= 3, seen


def test_keys_of_generated_tokens_are_kept_only_where_the_manager_says():
    """With `keep_generated` off (4-bit decode weights), a finished first choice leaves its prompt only."""
    for keep_generated, want in ((True, 7), (False, 5)):
        index = Index()
        kv = KVManager(MAX_LEN, slots=1, capacity=FIRST, prefix_index=index, keep_generated=keep_generated)
        memory = KVMemory(2, 1, 1, torch.float32, torch.device("cpu"))
        memory.reset(kv)
        g = group(1, 5, 2)
        rows, ops = kv.expand(g, 5)
        memory.apply(ops)
        for row in rows:
            write(memory, row)
            pick(row)
        for _ in range(2):
            decode_step(kv, memory)
        memory.apply(kv.release(g), index.keep)
        assert [len(ids) for ids in index.kept] == [want]  # the first choice only; its last pick never ran


def test_memory_works_outside_inference_mode_and_says_when_an_operation_failed():
    """The memory's methods run in inference mode whoever calls them (a class made inside it is grown and
    written outside it); an operation that fails part-way leaves the memory out of step, and says so."""
    kv = KVManager(MAX_LEN, slots=1, capacity=FIRST)
    memory = KVMemory(2, 1, 1, torch.float32, torch.device("cpu"))
    memory.reset(kv)
    first = group(1, 10, 1)
    with torch.inference_mode():  # a class of 16 made inside inference mode: inference tensors
        rows, ops = kv.expand(first, 10)
        memory.apply(ops)
        write(memory, rows[0])
    second = group(2, 10, 1)
    rows, ops = kv.expand(second, 10)  # outside it, the class grows and is written
    memory.apply(ops)
    write(memory, rows[0])
    assert list(memory.slabs) == [4, 16] and memory.slabs[16].num_slots == 2
    check(kv, memory, [first, second])
    memory.apply(kv.release(first))  # the other row moves into slot 0, outside inference mode
    check(kv, memory, [second])
    third = group(3, 3, 1)
    rows, ops = kv.expand(third, 3)
    memory.apply(ops)
    write(memory, rows[0])
    check(kv, memory, [second, third])
    with pytest.raises(KeyError):
        memory.apply([Move(999, 0, 4, 0, 3)])  # a class the memory does not hold
    assert not memory.matches(kv)  # out of step: the engine fails the step and starts both afresh
    kv.reset()
    memory.reset(kv)
    assert memory.matches(kv) and kv.is_consistent([])
