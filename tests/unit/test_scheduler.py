"""The scheduler (engine/scheduler.py) on made-up groups, with no model: arrival order, prompt-only
batches, the prefill budgets and chunks, the groups' computed tokens, lingering, and aborted groups."""

from __future__ import annotations

import pytest

from fake_backend import TinyTokenizer
from logprobe.backend import FinishReason, SamplingParams
from logprobe.engine.request import SequenceGroup
from logprobe.engine.scheduler import Scheduler
from logprobe.tokens import TokenTable

TABLE = TokenTable.build(TinyTokenizer(), 258)


def group(name: str, prompt_tokens: int, max_tokens: int = 4) -> SequenceGroup:
    return SequenceGroup(name, list(range(1, prompt_tokens + 1)), SamplingParams(max_tokens=max_tokens), TABLE)


def names(groups) -> list[str]:
    return [g.request_id for g in groups]


def chunks(plan) -> list[tuple[str, int]]:
    return [(c.group.request_id, c.num_tokens) for c in plan.prefill]


def run(scheduler: Scheduler, plan) -> None:
    """What the engine does with a plan, in bookkeeping only: a prompt whose chunks are all done starts
    decoding, each decode step adds a token, and a group ends at its max_tokens."""
    for group in plan.score:
        for seq in group.sequences:
            seq.finish_reason = FinishReason.LENGTH
        scheduler.finished(group)
    for group in plan.decode:
        for seq in group.sequences:
            seq.token_ids.append(0)
            if len(seq.token_ids) >= group.params.max_tokens:
                seq.finish_reason = FinishReason.LENGTH
        if group.is_finished:
            scheduler.finished(group)
    for chunk in plan.prefill:
        if chunk.group.num_computed_tokens == chunk.group.num_prompt_tokens:
            chunk.group.active_rows = [0]
            scheduler.prefilled(chunk.group)


def test_idle_scheduler_plans_nothing():
    scheduler = Scheduler()
    assert scheduler.schedule() is None and not scheduler.has_work and scheduler.num_in_flight == 0


def test_groups_are_served_in_arrival_order():
    scheduler = Scheduler()
    for name in "abc":
        scheduler.add(group(name, 5))
    plan = scheduler.schedule()
    assert chunks(plan) == [("a", 5), ("b", 5), ("c", 5)] and plan.decode == []
    run(scheduler, plan)
    plan = scheduler.schedule()
    assert names(plan.decode) == ["a", "b", "c"] and plan.prefill == []
    scheduler.add(group("d", 3))
    plan = scheduler.schedule()  # the newcomer's prompt beside the others' decode step
    assert names(plan.decode) == ["a", "b", "c"] and chunks(plan) == [("d", 3)]
    assert names(plan.groups) == ["d", "a", "b", "c"]
    assert plan.num_rows == 4  # a row per prompt, a row per decoding sequence


def test_prompt_only_groups_share_one_padded_batch():
    scheduler = Scheduler(score_batch_tokens=100, max_score_batch=3)
    for name, length in [("a", 10), ("b", 30), ("c", 20), ("d", 5), ("e", 5)]:
        scheduler.add(group(name, length, max_tokens=0))
    plan = scheduler.schedule()
    assert names(plan.score) == ["a", "b", "c"]  # 3 x 30 padded tokens fit 100; then max_score_batch
    assert plan.prefill == [] and plan.decode == []
    run(scheduler, plan)
    assert names(scheduler.schedule().score) == ["d", "e"]

    scheduler = Scheduler(score_batch_tokens=100)
    for name, length in [("a", 40), ("b", 40), ("c", 40)]:
        scheduler.add(group(name, length, max_tokens=0))
    assert names(scheduler.schedule().score) == ["a", "b"]  # a third would pad to 120


def test_prompt_only_batch_is_smaller_while_others_decode():
    scheduler = Scheduler(score_batch_tokens=1000, score_batch_tokens_decoding=50)
    scheduler.add(group("gen", 4, max_tokens=10))
    run(scheduler, scheduler.schedule())
    for name in "abc":
        scheduler.add(group(name, 20, max_tokens=0))
    plan = scheduler.schedule()
    assert names(plan.score) == ["a", "b"] and names(plan.decode) == ["gen"]  # 3 x 20 > 50


def test_groups_of_both_kinds_keep_their_order():
    """A prompt-only batch takes consecutive prompt-only groups from the head of the line; a generating
    group behind them is admitted in the same step, and one behind it waits for its turn."""
    scheduler = Scheduler()
    for name, max_tokens in [("score", 0), ("gen", 5), ("score2", 0), ("gen2", 5)]:
        scheduler.add(group(name, 5, max_tokens=max_tokens))
    plan = scheduler.schedule()
    assert names(plan.score) == ["score"] and chunks(plan) == [("gen", 5)]
    assert names(scheduler.waiting) == ["score2", "gen2"]  # not past the prompt-only group in front
    run(scheduler, plan)
    plan = scheduler.schedule()
    assert names(plan.score) == ["score2"] and names(plan.decode) == ["gen"] and chunks(plan) == [("gen2", 5)]


def test_admission_to_prefill_stops_at_the_pending_token_budget():
    scheduler = Scheduler(prefill_tokens=100)
    for name in "abcd":
        scheduler.add(group(name, 60))
    plan = scheduler.schedule()
    assert names(scheduler.prefilling) == ["a", "b"]  # 60 pending < 100 admits b; 120 stops c
    assert names(scheduler.waiting) == ["c", "d"]
    assert chunks(plan) == [("a", 60), ("b", 60)]


def test_admission_limits_on_groups():
    scheduler = Scheduler(max_prefilling=2)
    for name in "abc":
        scheduler.add(group(name, 1))
    scheduler.schedule()
    assert names(scheduler.prefilling) == ["a", "b"]
    scheduler = Scheduler(max_running=3)
    for name in "abcde":
        scheduler.add(group(name, 1, max_tokens=50))
    run(scheduler, scheduler.schedule())
    assert names(scheduler.running) == ["a", "b", "c"] and names(scheduler.waiting) == ["d", "e"]
    plan = scheduler.schedule()
    assert chunks(plan) == [] and len(plan.decode) == 3


def test_a_long_prompt_is_chunked_beside_decoding_groups():
    scheduler = Scheduler(prefill_chunk_tokens=16)
    scheduler.add(group("short", 3, max_tokens=100))
    run(scheduler, scheduler.schedule())
    long = group("long", 40)
    scheduler.add(long)
    seen = []
    while long not in scheduler.running:
        plan = scheduler.schedule()
        assert names(plan.decode) == ["short"]  # the decoding group steps every time
        seen.append((chunks(plan), long.num_computed_tokens))
        run(scheduler, plan)
    assert seen == [([("long", 16)], 16), ([("long", 16)], 32), ([("long", 8)], 40)]


def test_chunks_share_the_step_budget_in_order():
    scheduler = Scheduler(prefill_chunk_tokens=16)
    scheduler.add(group("gen", 2, max_tokens=100))
    run(scheduler, scheduler.schedule())
    for name, length in [("a", 10), ("b", 10), ("c", 10)]:
        scheduler.add(group(name, length))
    plan = scheduler.schedule()
    assert chunks(plan) == [("a", 10), ("b", 6)]  # c gets no chunk this step
    run(scheduler, plan)
    assert chunks(scheduler.schedule()) == [("b", 4), ("c", 10)]


def test_without_decoding_groups_prompts_are_packed_or_whole():
    scheduler = Scheduler(prefill_chunk_tokens=16, packed_prefill_tokens=100)
    scheduler.add(group("alone", 500))
    assert chunks(scheduler.schedule()) == [("alone", 500)]  # one prompt alone goes whole
    scheduler = Scheduler(prefill_chunk_tokens=16, packed_prefill_tokens=100, prefill_tokens=1000)
    for name, length in [("a", 30), ("b", 50), ("c", 40)]:
        scheduler.add(group(name, length))
    assert chunks(scheduler.schedule()) == [("a", 30), ("b", 50), ("c", 20)]


def test_a_runner_without_chunks_prefills_whole_prompts_beside_decoding():
    scheduler = Scheduler(prefill_chunk_tokens=None)
    scheduler.add(group("gen", 2, max_tokens=100))
    run(scheduler, scheduler.schedule())
    scheduler.add(group("long", 3000))
    assert chunks(scheduler.schedule()) == [("long", 3000)]


def test_lingering_waits_only_for_the_usual_companions():
    scheduler = Scheduler()
    assert not scheduler.should_linger()  # nothing seen yet
    for name in "abcd":
        scheduler.add(group(name, 5, max_tokens=0))
    run(scheduler, scheduler.schedule())
    assert scheduler.last_prompt_only == 4
    scheduler.add(group("e", 5, max_tokens=0))
    assert scheduler.should_linger()  # one of four clients is back: wait for the others
    for name in "fgh":
        scheduler.add(group(name, 5, max_tokens=0))
    assert not scheduler.should_linger()  # all four are back
    run(scheduler, scheduler.schedule())
    scheduler.add(group("gen", 5))
    assert not scheduler.should_linger()  # a generating request never waits
    scheduler.linger_s = 0
    scheduler.waiting.clear()
    scheduler.add(group("i", 5, max_tokens=0))
    assert not scheduler.should_linger()  # lingering turned off


def test_a_lone_client_never_lingers_and_decoding_ends_lingering():
    scheduler = Scheduler()
    scheduler.add(group("a", 5, max_tokens=0))
    run(scheduler, scheduler.schedule())
    assert scheduler.last_prompt_only == 1
    scheduler.add(group("b", 5, max_tokens=0))
    assert not scheduler.should_linger()
    scheduler = Scheduler()
    for name in "ab":
        scheduler.add(group(name, 5, max_tokens=0))
    run(scheduler, scheduler.schedule())
    scheduler.add(group("gen", 5, max_tokens=10))
    run(scheduler, scheduler.schedule())
    scheduler.add(group("c", 5, max_tokens=0))
    assert not scheduler.should_linger()  # something decodes: its next step should not wait
    plan = scheduler.schedule()
    assert names(plan.score) == ["c"] and scheduler.last_prompt_only == 2  # not a batch run alone


@pytest.mark.parametrize("where", ["waiting", "prefilling", "running"])
def test_aborted_groups_are_dropped_before_they_cost_a_pass(where):
    scheduler = Scheduler(prefill_chunk_tokens=4)
    keep, gone = group("keep", 2, max_tokens=100), group("gone", 20, max_tokens=100)
    scheduler.add(keep)
    if where != "waiting":
        run(scheduler, scheduler.schedule())
    scheduler.add(gone)
    if where == "running":
        while gone not in scheduler.running:
            run(scheduler, scheduler.schedule())
    elif where == "prefilling":
        run(scheduler, scheduler.schedule())
        assert gone in scheduler.prefilling
    gone.is_aborted = True
    plan = scheduler.schedule()
    assert gone not in plan.groups and keep in plan.groups
    assert scheduler.take_dropped() == [gone] and scheduler.take_dropped() == []
    assert scheduler.num_in_flight == 1


def test_only_aborted_groups_leave_nothing_to_plan():
    scheduler = Scheduler()
    gone = group("gone", 5)
    scheduler.add(gone)
    gone.is_aborted = True
    assert scheduler.schedule() is None and scheduler.take_dropped() == [gone] and not scheduler.has_work


def test_a_group_that_finishes_with_its_prompt_does_not_decode():
    scheduler = Scheduler()
    g = group("one", 3, max_tokens=1)
    scheduler.add(g)
    scheduler.schedule()
    g.sequences[0].finish_reason = FinishReason.LENGTH  # its first token was its last
    scheduler.prefilled(g)
    scheduler.finished(g)
    assert not scheduler.has_work and g.num_computed_tokens == 3
