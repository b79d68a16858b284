"""The runner contract (engine/contract.py): both runners implement every method it declares, with its
parameters; the engine's host side asks a runner nothing else and never what it can do (no getattr or
hasattr on a runner); and a runner's per-request state lives in its own records, never on the
scheduler's groups."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest
import torch

from logprobe.engine import core
from logprobe.engine.runners import lean
from logprobe.engine.contract import Runner
from logprobe.engine.core import EngineCore
from logprobe.engine.host.request import SamplingParams, SequenceGroup
from logprobe.engine.runners.model_runner import ModelRunner
from logprobe.engine.runners.prompt_columns import drain

ENGINE = Path(core.__file__).parent
DECLARED = [name for name, value in vars(Runner).items() if inspect.isfunction(value) and not name.startswith("_")]


@pytest.fixture(scope="module")
def runners(tiny_model):
    return {"lean": lean.LeanRunner(tiny_model, max_len=64), "transformers": ModelRunner(tiny_model)}


@pytest.mark.parametrize("kind", ["lean", "transformers"])
def test_both_runners_implement_the_contract(kind, runners):
    runner = runners[kind]
    assert isinstance(runner, Runner)
    assert len(DECLARED) >= 20
    for name in DECLARED:
        want = list(inspect.signature(getattr(Runner, name)).parameters)[1:]
        got = list(inspect.signature(getattr(runner, name)).parameters)
        assert got == want, (kind, name)
    for name in Runner.__annotations__:
        assert hasattr(runner, name), (kind, name)
    stats = runner.cache_stats()
    assert set(stats) == {"kv_cache_bytes", "prefix_cache_bytes", "prefix_cache_hits", "prefix_cache_misses",
                          "prefix_cache_tokens_saved"}


def test_the_core_refuses_a_runner_that_is_not_one():
    class Half:
        def prompt_pass(self, groups, hits):
            yield from ()

    with pytest.raises(TypeError, match="runner contract"):
        EngineCore(Half(), None, None, [0])


def _runner_calls(tree: ast.AST) -> tuple[set[str], list[str]]:
    """(attributes read on `runner`/`self.runner`, getattr/hasattr calls on one) in a module's code."""
    attrs, sniffs = set(), []

    def is_runner(node) -> bool:
        return (isinstance(node, ast.Name) and node.id == "runner") or \
            (isinstance(node, ast.Attribute) and node.attr == "runner")

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_runner(node.value):
            attrs.add(node.attr)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and node.args and is_runner(node.args[0]):
            sniffs.append(ast.unparse(node))
    return attrs, sniffs


@pytest.mark.parametrize("module", ["core.py", "engine.py", "host/captures.py", "device/tree_passes.py",
                                    "runners/prompt_columns.py"])
def test_the_host_side_calls_only_the_contract(module):
    attrs, sniffs = _runner_calls(ast.parse((ENGINE / module).read_text()))
    assert not sniffs
    declared = set(DECLARED) | set(Runner.__annotations__)
    assert not attrs - declared, attrs - declared


def test_groups_carry_no_runner_state(runners, tokenizer):
    """A group prefilled and decoding on the lean runner has no runner attribute; its prompt state is in
    the runner's records, its rows in the KV cache manager's, and both gone when it is released."""
    from logprobe.tokens import TokenTable

    runner = runners["lean"]
    table = TokenTable.build(tokenizer, runner.vocab_size)
    group = SequenceGroup("t", [1, 5, 6, 7, 8], SamplingParams(max_tokens=3), table)
    before = set(vars(group))
    runner.start_prompt(group)
    assert runner.prefill_chunks([(group, 100)])[0] is not None
    group.active_rows = [0]
    runner.expand(group, *runner.kv.expand(group, group.num_prompt_tokens))
    assert set(vars(group)) == before
    assert len(runner.rows_of(group)) == 1 and runner.is_consistent([group]) and runner.kv.is_consistent([group])
    runner.release(group, runner.kv.release(group))
    assert not runner.records and runner.kv.num_rows == 0 and runner.is_consistent([])
    assert "cache" not in vars(group) and "rows" not in vars(group)


@pytest.mark.parametrize("kind", ["lean", "transformers"])
def test_runners_hand_the_prompt_columns_over(kind, runners, tokenizer):
    """Neither runner writes a group's prompt columns: a prompt-only batch and a generation's prompt
    (in chunks on the lean runner) leave `group.prompt_columns` unset, `prompt_columns(group)` hands
    the columns over once (then None), and a released group's are gone."""
    from logprobe.tokens import TokenTable

    runner = runners[kind]
    runner.reset()
    table = TokenTable.build(tokenizer, runner.vocab_size)
    scored = [SequenceGroup(f"s{i}", ids, SamplingParams(max_tokens=0, prompt_logprobs=2), table)
              for i, ids in enumerate([[1, 5, 6, 7, 8], [1, 9, 10]])]
    with torch.inference_mode():
        drain(runner.prompt_pass(scored, None))
        assert all(g.prompt_columns is None for g in scored)
        handed = [runner.prompt_columns(g) for g in scored]
        assert [c.logprobs.shape for c in handed] == [(5,), (3,)]
        assert all(runner.prompt_columns(g) is None for g in scored)
        generated = SequenceGroup("g", [1, 5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=2, prompt_logprobs=1), table)
        runner.start_prompt(generated)
        out = [runner.prefill_chunks([(generated, 3)])[0]]
        while out[-1] is None:
            out.append(runner.prefill_chunks([(generated, 3)])[0])
        assert generated.prompt_columns is None
        columns = runner.prompt_columns(generated)
        assert columns.logprobs.shape == (7,) and np.isfinite(columns.logprobs[1:]).all()
        # a group released before its columns were taken leaves none behind
        dropped = SequenceGroup("d", [1, 5, 6], SamplingParams(max_tokens=0, prompt_logprobs=1), table)
        drain(runner.prompt_pass([dropped], None))
        for g in [*scored, generated, dropped]:
            runner.release(g)
        assert runner.prompt_columns(dropped) is None
