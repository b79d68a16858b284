"""How a batch of prompt-only prompts is cut into passes of like length (engine/runners/lean/prompt_batch.by_length)."""

from __future__ import annotations

from logprobe.engine.runners.lean.prompt_batch import by_length


def padding(lengths: list[int], passes: list[list[int]]) -> float:
    padded = sum(max(lengths[i] for i in p) * len(p) for p in passes)
    return 1 - sum(lengths) / padded


def test_every_prompt_once_shortest_first():
    lengths = [300, 9, 21, 73, 9, 300, 21, 73] * 8
    passes = by_length(lengths, 0.15, 128)
    assert sorted(i for p in passes for i in p) == list(range(len(lengths)))
    longest = [max(lengths[i] for i in p) for p in passes]
    assert longest == sorted(longest)
    assert padding(lengths, passes) < 0.15 < padding(lengths, [list(range(len(lengths)))])


def test_a_little_padding_is_cheaper_than_a_pass():
    lengths = [2, 5, 9, 14, 30]  # 90 tokens of padding: less than another pass costs
    assert by_length(lengths, 0.15, 128) == [[0, 1, 2, 3, 4]]
    assert by_length([], 0.15, 128) == []


def test_like_lengths_are_one_pass():
    lengths = [100, 101, 99, 100] * 20
    assert len(by_length(lengths, 0.15, 128)) == 1
