"""A decode step moves a fixed number of small arrays from the device to the host, whatever the batch:
tokens, their log probabilities and top-k for every row come back in one transfer. On a CPU nothing is
actually copied, so the test counts the calls that would wait for a GPU and copy (`.cpu()`, `.item()`,
`.tolist()`, `.numpy()`, `int(t)`, `float(t)`, `bool(t)`, `.to("cpu")`...) while the engine takes one
decode step of plain requests, on both runners, and fails if the count grows with the batch."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from logprobe.engine.device import top_k as top_k_module
from logprobe.engine.engine import Engine
from logprobe.engine.host.request import SamplingParams, SequenceGroup

TO_HOST = {"cpu", "item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__", "__array__"}


class CountTransfers(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in TO_HOST:
            self.calls.append(name)
        elif name == "to" and "cpu" in [*args[1:], *kwargs.values()]:  # `.to(device=x.device)` is not a move
            self.calls.append(name)
        return func(*args, **kwargs)


# plain requests of every kind of setting: greedy, temperature, top-k, top-p, several choices, logprobs
KINDS = [dict(temperature=0.0, logprobs=5), dict(temperature=1.0, seed=1), dict(temperature=0.7, top_p=0.9, n=2, seed=2),
         dict(temperature=1.3, top_k=20, logprobs=2, seed=3), dict(temperature=0.0)]


# what the fixed-shape step picks in its recorded pass: no top-k, no top-p
UNFILTERED = [dict(temperature=0.0, logprobs=5), dict(temperature=1.0, seed=1, n=2), dict(temperature=0.7, logprobs=2)]


def decode_step_transfers(engine: Engine, batch: int, kinds=KINDS) -> list[str]:
    groups = []
    while sum(g.params.n for g in groups) < batch:
        kind = dict(kinds[len(groups) % len(kinds)])
        kind["n"] = min(kind.get("n", 1), batch - sum(g.params.n for g in groups))
        ids = engine.tokenizer(f"request {len(groups)} of a batch").input_ids
        groups.append(SequenceGroup(f"r{len(groups)}", ids, SamplingParams(max_tokens=50, **kind), engine.table))
    for group in groups:
        engine.scheduler.add(group)
    with torch.inference_mode():
        while True:
            plan = engine.scheduler.schedule()
            if len(plan.decode) == len(groups) and not (plan.prefill or plan.score):
                break
            engine.step(plan)
        assert sum(len(g.active_rows) for g in plan.decode) == batch
        with CountTransfers() as counter:
            engine.step(plan)
        assert all(len(s.token_ids) >= 2 for g in groups for s in g.sequences)  # the step did decode
        for group in groups:
            engine.runner.release(group, engine.kv.release(group))
            engine.scheduler.finished(group)
    return counter.calls


@pytest.mark.parametrize("fast,static", [(True, False), (True, True), (False, False)],
                         ids=["lean", "lean-fixed-shape", "transformers"])
def test_a_decode_step_moves_the_same_arrays_whatever_the_batch(fast, static, tiny_model, tokenizer, monkeypatch):
    """`lean-fixed-shape`: the step a GPU records as a CUDA graph, which picks the tokens in the
    recorded pass for the batches without top-k or top-p (all but the batch of one here)."""
    engine = Engine(tiny_model, tokenizer, "tiny", [], fast=fast)
    # what a GPU's step does: device/top_k.py branches on ties only on a CPU, where reading them is free
    monkeypatch.setattr(top_k_module, "reads_on_host", lambda rows: False)
    if static:
        engine.runner.static_decode = True
    counts = {batch: decode_step_transfers(engine, batch) for batch in (1, 4, 16)}
    assert counts[1] == counts[4] == counts[16], counts
    assert counts[1] == ["cpu", "numpy"]  # one transfer: a device array brought to the host, then read
    if static:  # and where the recorded pass picks the tokens, at every batch size
        picked = []
        original = engine.runner.decode_and_pick
        engine.runner.decode_and_pick = lambda groups, k: (lambda out: picked.append(out[1] is not None) or out)(
            original(groups, k))
        counts = {batch: decode_step_transfers(engine, batch, UNFILTERED) for batch in (1, 4, 16)}
        assert counts[1] == counts[4] == counts[16] == ["cpu", "numpy"], counts
        assert picked and all(picked)


def test_the_count_sees_a_transfer_per_row(tiny_model, tokenizer, monkeypatch):
    """The counter is not blind: a per-row read of the log probabilities (what the engine once did)
    makes the count grow with the batch."""
    engine = Engine(tiny_model, tokenizer, "tiny", [])
    original = Engine._decoded

    def per_row(self, group, logprob_rows, pick):
        for row in range(logprob_rows.shape[0]):
            float(logprob_rows[row, 0])
        return original(self, group, logprob_rows, pick)

    monkeypatch.setattr(Engine, "_decoded", per_row)
    assert len(decode_step_transfers(engine, 4)) > len(decode_step_transfers(engine, 1))
