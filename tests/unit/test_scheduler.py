"""The scheduler (engine/host/scheduler.py) on made-up groups, with no model: arrival order, prompt-only
batches, the prefill budgets and chunks, the groups' computed tokens, lingering, aborted groups, and
interactive groups served before batch groups."""

from __future__ import annotations

import pytest

from fake_backend import TinyTokenizer
from logprobe.backend import FinishReason, SamplingParams
from logprobe.config import SchedulerSettings
from logprobe.engine.host.prefix_index import PrefixIndex, StoreState
from logprobe.engine.host.request import SequenceGroup
from logprobe.engine.host.scheduler import PromptPass, Scheduler
from logprobe.tokens import TokenTable

TABLE = TokenTable.build(TinyTokenizer(), 258)


def group(name: str, prompt_tokens: int, max_tokens: int = 4, priority: str = "interactive") -> SequenceGroup:
    made = SequenceGroup(name, list(range(1, prompt_tokens + 1)), SamplingParams(max_tokens=max_tokens), TABLE)
    made.priority = priority
    return made


def batch(name: str, prompt_tokens: int, max_tokens: int = 4) -> SequenceGroup:
    return group(name, prompt_tokens, max_tokens, priority="batch")


def names(groups) -> list[str]:
    return [g.request_id for g in groups]


def chunks(plan) -> list[tuple[str, int]]:
    return [(c.group.request_id, c.num_tokens) for c in plan.prefill]


def run(scheduler: Scheduler, plan, paused: bool = False) -> None:
    """What the engine does with a plan, in bookkeeping only: a prompt whose chunks are all done starts
    decoding, each decode step adds a token, a group ends at its max_tokens, and a prompt-only pass runs
    to its end (`paused`: it pauses before, and stays begun)."""
    if plan.prompt_pass is not None and paused:
        plan.prompt_pass.steps = "paused"  # begun: the engine holds the runner's pass here
    elif plan.prompt_pass is not None:  # the pass runs to its end
        scheduler.pass_done(plan.prompt_pass)
    for group in [] if paused else plan.score:
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
    scheduler = Scheduler(SchedulerSettings(score_batch_tokens=100, max_score_batch=3))
    for name, length in [("a", 10), ("b", 30), ("c", 20), ("d", 5), ("e", 5)]:
        scheduler.add(group(name, length, max_tokens=0))
    plan = scheduler.schedule()
    assert names(plan.score) == ["a", "b", "c"]  # 3 x 30 padded tokens fit 100; then max_score_batch
    assert plan.prefill == [] and plan.decode == []
    run(scheduler, plan)
    assert names(scheduler.schedule().score) == ["d", "e"]

    scheduler = Scheduler(SchedulerSettings(score_batch_tokens=100))
    for name, length in [("a", 40), ("b", 40), ("c", 40)]:
        scheduler.add(group(name, length, max_tokens=0))
    assert names(scheduler.schedule().score) == ["a", "b"]  # a third would pad to 120


def test_prompt_only_batch_is_smaller_while_others_decode():
    scheduler = Scheduler(SchedulerSettings(score_batch_tokens=1000, score_batch_tokens_decoding=50))
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
    scheduler = Scheduler(SchedulerSettings(prefill_tokens=100))
    for name in "abcd":
        scheduler.add(group(name, 60))
    plan = scheduler.schedule()
    assert names(scheduler.prefilling) == ["a", "b"]  # 60 pending < 100 admits b; 120 stops c
    assert names(scheduler.waiting) == ["c", "d"]
    assert chunks(plan) == [("a", 60), ("b", 60)]


def test_admission_limits_on_groups():
    scheduler = Scheduler(SchedulerSettings(max_prefilling=2))
    for name in "abc":
        scheduler.add(group(name, 1))
    scheduler.schedule()
    assert names(scheduler.prefilling) == ["a", "b"]
    scheduler = Scheduler(SchedulerSettings(max_running=3))
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


class Memory(StoreState):
    """What the prefix index reads of a runner's store (its capacity, size, whether it keeps hidden
    states), without the memory."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.nbytes, self.has_hidden = capacity, capacity, False


def test_the_tokens_the_prefix_cache_holds_are_computed_at_admission():
    """The scheduler finds, as it admits a group to prefill, how many of its prompt's tokens the engine's
    prefix index holds (its longest kept prefix in whole blocks) and hands the hit to the runner
    (`start_prompt`): those tokens count as computed, so chunks cover the rest only and the step's budget
    goes on to the next prompt, admission counts only the tokens still to run, and a prompt held whole
    but its last token still runs that token (its hidden state gives the first token)."""
    lengths = {"gen": 2, "a": 40, "b": 40, "c": 97, "d": 60, "e": 10}
    ids = {name: [1000 * k + i for i in range(n)] for k, (name, n) in enumerate(lengths.items())}
    index = PrefixIndex(2**20)
    for name, kept in (("a", 32), ("c", 96), ("d", 48)):
        assert index.adopt(ids[name][:kept], Memory(kept))
    asked = []

    def start_prompt(g, hit, held):
        asked.append((g.request_id, None if hit is None else hit.length, held))

    scheduler = Scheduler(SchedulerSettings(prefill_tokens=60, max_prefilling=8), prefill_chunk_tokens=16,
                          start_prompt=start_prompt, prefix_index=index)

    def made(name, max_tokens=4):
        return SequenceGroup(name, ids[name], SamplingParams(max_tokens=max_tokens), TABLE)

    scheduler.add(made("gen", max_tokens=100))
    run(scheduler, scheduler.schedule())
    for name in "abcde":
        scheduler.add(made(name))
    plan = scheduler.schedule()
    # pending before each admission: a 0, b 8, c 48, d 49 (all < 60), e 61: e waits
    assert names(scheduler.prefilling) == ["a", "b", "c", "d"] and names(scheduler.waiting) == ["e"]
    # once each, as it was admitted, with what the index holds of it
    assert asked == [("gen", None, 0), ("a", 32, 32), ("b", None, 0), ("c", 96, 96), ("d", 48, 48)]
    assert chunks(plan) == [("a", 8), ("b", 8)]  # a's 8 left, then the rest of the step's 16
    seen = []
    while plan is not None and (scheduler.prefilling or scheduler.waiting):
        seen += chunks(plan)
        run(scheduler, plan)
        plan = scheduler.schedule()
    ran = {name: sum(n for who, n in seen if who == name) for name in lengths}
    assert ran == {"gen": 0, "a": 8, "b": 40, "c": 1, "d": 12, "e": 10}, seen
    assert index.hits == 3 and index.tokens_saved == 32 + 96 + 48


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
    scheduler = Scheduler(SchedulerSettings(packed_prefill_tokens=100), prefill_chunk_tokens=16)
    scheduler.add(group("alone", 500))
    assert chunks(scheduler.schedule()) == [("alone", 500)]  # one prompt alone goes whole
    scheduler = Scheduler(SchedulerSettings(packed_prefill_tokens=100, prefill_tokens=1000), prefill_chunk_tokens=16)
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


def test_a_finished_groups_captures_are_an_item_of_the_next_plan():
    """A group that finished and asked for captures leaves the step's queues, stays in flight, and the
    next plan carries it (Plan.captures) beside the other work; a plan of captures alone is a plan.
    An interactive step between a batch pass's blocks takes only interactive groups' captures."""
    scheduler = Scheduler()
    done, other, lines = group("done", 3, max_tokens=8), group("other", 3, max_tokens=8), batch("line", 3, 8)
    for g in (done, other, lines):
        scheduler.add(g)
    while len(scheduler.running) < 3:
        run(scheduler, scheduler.schedule())
    for g in (done, lines):
        g.sequences[0].finish_reason = FinishReason.LENGTH
        scheduler.capture(g)
    assert scheduler.num_in_flight == 3 and scheduler.has_interactive_work
    assert names(scheduler.running) == ["other"] and names(scheduler.capturing) == ["done", "line"]
    paused = begun(scheduler, batch("pass", 5, max_tokens=0))  # a batch prompt-only pass, paused
    plan = scheduler.schedule()
    assert plan.prompt_pass is paused and names(plan.captures) == ["done"] and names(plan.decode) == ["other"]
    assert names(scheduler.capturing) == ["line"]  # a batch group's captures wait for the pass's end
    scheduler.pass_done(paused)
    scheduler.finished(done)
    other.is_aborted = True
    plan = scheduler.schedule()
    assert names(plan.captures) == ["line"] and other not in plan.groups and lines in plan.groups
    scheduler.finished(lines)
    assert scheduler.schedule() is None and not scheduler.has_work and scheduler.num_in_flight == 0
    # between the blocks of an interactive prompt-only pass: an interactive group's captures, not a batch one's
    late, line = group("late", 3, max_tokens=1), batch("line2", 3, 1)
    for g in (late, line):
        scheduler.capture(g)
    assert scheduler.has_interactive_captures
    paused = begun(scheduler, group("scoring", 5, max_tokens=0))
    assert scheduler.should_pause(paused)  # the captures are worth a step of their own
    plan = scheduler.schedule()
    assert plan.prompt_pass is paused and names(plan.captures) == ["late"] and names(scheduler.capturing) == ["line2"]
    assert not scheduler.has_interactive_captures and not scheduler.should_pause(paused)
    assert names(scheduler.schedule().groups) == ["scoring"]  # the pass alone goes on


def begun(scheduler: Scheduler, *groups: SequenceGroup) -> PromptPass:
    """A prompt-only pass of `groups`, begun and paused (as the engine leaves one when it ends a step at
    one of the pass's pause points)."""
    made = PromptPass(list(groups), steps="paused")
    scheduler.passes.append(made)
    return made


def test_an_aborted_group_waiting_for_its_captures_is_dropped():
    scheduler = Scheduler()
    g = group("gone", 3, max_tokens=1)
    scheduler.add(g)
    run(scheduler, scheduler.schedule())
    g.sequences[0].finish_reason = FinishReason.LENGTH
    scheduler.capture(g)
    g.is_aborted = True
    assert scheduler.schedule() is None and scheduler.take_dropped() == [g] and not scheduler.has_work


# ---- priorities: interactive groups before batch groups -------------------------------------------


def test_interactive_groups_go_ahead_of_waiting_batch_groups_in_arrival_order():
    scheduler = Scheduler()
    for made in [batch("b1", 5), batch("b2", 5), group("i1", 5), batch("b3", 5), group("i2", 5)]:
        scheduler.add(made)
    assert names(scheduler.waiting) == ["i1", "i2", "b1", "b2", "b3"]
    plan = scheduler.schedule()
    assert chunks(plan) == [("i1", 5), ("i2", 5)]  # no batch group takes budget while they waited
    run(scheduler, plan)
    plan = scheduler.schedule()  # nothing interactive waits: the batch groups fill the machine
    assert chunks(plan) == [("b1", 5), ("b2", 5), ("b3", 5)] and names(plan.decode) == ["i1", "i2"]


def test_batch_prompt_only_groups_never_join_an_interactive_pass():
    scheduler = Scheduler(SchedulerSettings(score_batch_tokens=1000))
    for name in ["b1", "b2", "b3"]:
        scheduler.add(batch(name, 10, max_tokens=0))
    scheduler.add(group("i", 10, max_tokens=0))
    plan = scheduler.schedule()
    assert names(plan.score) == ["i"] and plan.prefill == []
    run(scheduler, plan)
    assert names(scheduler.schedule().score) == ["b1", "b2", "b3"]


def test_an_interactive_prompt_pauses_batch_prompts_but_not_batch_decoding():
    scheduler = Scheduler(prefill_chunk_tokens=16)
    scheduler.add(batch("b-gen", 3, max_tokens=100))
    run(scheduler, scheduler.schedule())
    scheduler.add(batch("b-long", 64))
    run(scheduler, scheduler.schedule())
    assert names(scheduler.prefilling) == ["b-long"] and scheduler.prefilling[0].num_computed_tokens == 16
    scheduler.add(batch("b-next", 4))
    scheduler.add(group("i", 20, max_tokens=5))
    plan = scheduler.schedule()
    assert chunks(plan) == [("i", 16)] and names(plan.decode) == ["b-gen"]  # b-long gets no chunk
    assert names(scheduler.waiting) == ["b-next"]  # admitted in no step that began with "i" waiting
    run(scheduler, plan)
    plan = scheduler.schedule()
    assert chunks(plan) == [("i", 4)] and names(plan.decode) == ["b-gen"]
    run(scheduler, plan)
    plan = scheduler.schedule()  # "i" decodes; the batch prompts go on
    assert names(plan.decode) == ["b-gen", "i"] and chunks(plan) == [("b-long", 16)]
    assert names(scheduler.prefilling) == ["b-long", "b-next"]


def test_batch_prompts_being_prefilled_do_not_fill_the_budgets_of_interactive_ones():
    scheduler = Scheduler(SchedulerSettings(prefill_tokens=100, max_prefilling=2), prefill_chunk_tokens=8)
    scheduler.add(batch("b-gen", 3, max_tokens=100))
    run(scheduler, scheduler.schedule())
    for name in ["b1", "b2"]:
        scheduler.add(batch(name, 200))
    run(scheduler, scheduler.schedule())
    assert names(scheduler.prefilling) == ["b1"]  # 200 pending tokens stop b2 ...
    scheduler.add(group("i1", 30))
    scheduler.add(group("i2", 30))
    plan = scheduler.schedule()  # ... but not the interactive prompts, counted among themselves
    assert names(scheduler.prefilling) == ["b1", "i1", "i2"]
    assert chunks(plan) == [("i1", 8)]  # the step's 8 tokens, none for b1
    scheduler.add(group("i3", 30))
    scheduler.schedule()
    assert names(scheduler.waiting) == ["i3", "b2"]  # two interactive prompts already: max_prefilling


def test_batch_groups_leave_slots_for_interactive_ones_and_the_next_free_slot_is_theirs():
    scheduler = Scheduler(SchedulerSettings(max_running=8))
    assert scheduler.max_batch_running == 7
    for i in range(10):
        scheduler.add(batch(f"b{i}", 2, max_tokens=1 if i == 0 else 50))
    run(scheduler, scheduler.schedule())
    assert len(scheduler.running) == 7 and len(scheduler.waiting) == 3  # the eighth slot stays free ...
    scheduler.add(group("i1", 2, max_tokens=50))
    assert chunks(scheduler.schedule()) == [("i1", 2)]  # ... for an interactive group, at once
    scheduler.running.append(scheduler.prefilling.pop())  # (as if it had been prefilled)
    scheduler.add(group("i2", 2, max_tokens=3))
    plan = scheduler.schedule()  # all eight slots taken: the batch rows keep decoding
    assert chunks(plan) == [] and len(plan.decode) == 8
    run(scheduler, plan)  # b0 ends
    plan = scheduler.schedule()
    assert chunks(plan) == [("i2", 2)] and names(scheduler.waiting) == ["b7", "b8", "b9"]


def test_a_single_slot_serves_batch_groups_too():
    scheduler = Scheduler(SchedulerSettings(max_running=1))
    scheduler.add(batch("b", 2))
    assert chunks(scheduler.schedule()) == [("b", 2)]


def test_batch_groups_do_not_make_the_engine_linger():
    scheduler = Scheduler()
    for name in "abcd":
        scheduler.add(batch(name, 5, max_tokens=0))
    run(scheduler, scheduler.schedule())
    assert scheduler.last_prompt_only == 0  # a batch's pass says nothing of interactive clients
    for name in "abcd":
        scheduler.add(group(name, 5, max_tokens=0))
    run(scheduler, scheduler.schedule())
    scheduler.add(group("e", 5, max_tokens=0))
    assert scheduler.should_linger()
    scheduler.add(batch("f", 5, max_tokens=0))
    assert not scheduler.should_linger()  # batch lines wait: there is work to do


@pytest.mark.parametrize("max_tokens", [0, 6])
def test_an_interactive_request_among_200_batch_lines_runs_in_the_next_step(max_tokens):
    """200 batch lines queued and running (prompt-only or generating): an interactive request that
    arrives is in the very next step's plan, its prompt in a pass of its own kind, while every batch
    line still completes."""
    scheduler = Scheduler(SchedulerSettings(max_running=64), prefill_chunk_tokens=32)
    lines = [batch(f"b{i}", 10 + i % 50, max_tokens=max_tokens) for i in range(200)]
    for line in lines:
        scheduler.add(line)
    run(scheduler, scheduler.schedule())
    assert sum(line in scheduler.waiting for line in lines) > 100  # most are still queued
    interactive = group("i", 40, max_tokens=max_tokens)
    scheduler.add(interactive)
    plan = scheduler.schedule()
    assert interactive in plan.score or [c.group for c in plan.prefill] == [interactive]
    assert not any(g.is_batch for g in plan.score) and all(not c.group.is_batch for c in plan.prefill)
    steps = 1
    run(scheduler, plan)
    while not interactive.is_finished:
        plan = scheduler.schedule()
        run(scheduler, plan)
        steps += 1
    if max_tokens:  # its prompt (two chunks of 32 at most) then a token per step
        assert interactive.num_computed_tokens == 40 and steps <= 2 + max_tokens
    while scheduler.has_work:
        run(scheduler, scheduler.schedule())
    assert all(line.is_finished for line in lines)


def test_batch_prompt_only_passes_hold_at_most_batch_step_tokens():
    """Batch scoring lines share a pass of at most `batch_step_tokens` padded tokens (an interactive
    request arriving mid-step waits for no more); interactive ones keep the larger budget."""
    scheduler = Scheduler(SchedulerSettings(batch_step_tokens=128), prefill_chunk_tokens=256)
    for i in range(10):
        scheduler.add(batch(f"b{i}", 30, max_tokens=0))
    plan = scheduler.schedule()
    assert names(plan.score) == ["b0", "b1", "b2", "b3"]  # 4 x 30 <= 128 < 5 x 30
    run(scheduler, plan)
    for i in range(10):
        scheduler.add(group(f"i{i}", 30, max_tokens=0))
    plan = scheduler.schedule()
    assert names(plan.score) == [f"i{i}" for i in range(10)]


def test_a_long_batch_prompt_only_line_is_prefilled_in_chunks():
    """A batch scoring line longer than `batch_step_tokens` goes through chunked prefill, a chunk of at
    most `batch_step_tokens` a step, beside an interactive prompt that gets its own budget; without a
    chunking runner it runs whole in a prompt-only pass."""
    scheduler = Scheduler(SchedulerSettings(batch_step_tokens=128), prefill_chunk_tokens=256)
    scheduler.add(batch("long", 300, max_tokens=0))
    plan = scheduler.schedule()
    assert not plan.score and chunks(plan) == [("long", 128)]
    run(scheduler, plan)
    scheduler.add(group("chat", 40))
    plan = scheduler.schedule()  # the interactive prompt's step gives the batch prompt no chunk
    assert chunks(plan) == [("chat", 40)]
    run(scheduler, plan)
    plan = scheduler.schedule()
    assert chunks(plan) == [("long", 128)] and names(plan.decode) == ["chat"]
    run(scheduler, plan)
    plan = scheduler.schedule()
    assert chunks(plan) == [("long", 44)]
    whole = Scheduler(SchedulerSettings(batch_step_tokens=128), prefill_chunk_tokens=None)
    whole.add(batch("long", 300, max_tokens=0))
    assert names(whole.schedule().score) == ["long"]


# ---- interactive steps between the blocks of a batch pass ---------------------------------------


def test_an_interleaving_runner_takes_longer_batch_passes_and_whole_scoring_lines():
    """Where the runner stops between blocks for interactive steps, a batch prompt-only pass holds up to
    `batch_pass_tokens` and a scoring line up to that long runs whole in one; a longer one, and a batch
    prompt to generate from, are still prefilled in chunks of `batch_step_tokens`."""
    scheduler = Scheduler(SchedulerSettings(batch_step_tokens=128, batch_pass_tokens=512), prefill_chunk_tokens=256, interleaves=True)
    for i in range(20):
        scheduler.add(batch(f"b{i}", 30, max_tokens=0))
    plan = scheduler.schedule()
    assert names(plan.score) == [f"b{i}" for i in range(17)]  # 17 x 30 <= 512 < 18 x 30
    run(scheduler, plan)
    run(scheduler, scheduler.schedule())
    scheduler.add(batch("scoring-400", 400, max_tokens=0))
    plan = scheduler.schedule()
    assert names(plan.score) == ["scoring-400"] and not plan.prefill
    run(scheduler, plan)
    scheduler.add(batch("scoring-600", 600, max_tokens=0))
    scheduler.add(batch("generating-400", 400, max_tokens=4))
    plan = scheduler.schedule()
    assert not plan.score and chunks(plan) == [("scoring-600", 128)]


def test_a_step_beside_a_batch_pass_holds_interactive_prompts_and_every_decoding_row():
    """A step while a batch prompt-only pass is begun (`_beside_batch_pass`) goes on with the pass and
    plans the interactive prompts beside it (a new interactive prompt-only pass in its place), never a
    batch prompt (waiting or being prefilled); running batch groups decode beside the interactive ones
    (a decode pass takes every row of the KV cache). The pass pauses while interactive work waits, and
    with none it runs on (`should_pause`). Once it is done, the next step has everyone."""
    scheduler = Scheduler(SchedulerSettings(batch_step_tokens=16), prefill_chunk_tokens=32, interleaves=True)
    scheduler.add(batch("b-gen", 3, max_tokens=100))
    run(scheduler, scheduler.schedule())  # b-gen decodes from now on
    scheduler.add(batch("b-long", 64))
    run(scheduler, scheduler.schedule())  # b-long is being prefilled
    scheduler.add(batch("b-score", 10, max_tokens=0))
    scheduler.add(batch("b-next", 10, max_tokens=0))
    plan = scheduler.schedule()  # the pass of the batch scoring lines begins, beside the batch work
    lines = plan.prompt_pass
    assert names(plan.score) == ["b-score", "b-next"] and names(plan.decode) == ["b-gen"]
    assert not scheduler.has_interactive_work and not scheduler.should_pause(lines)  # nothing to pause for
    run(scheduler, plan, paused=True)
    scheduler.add(group("i-gen", 40, max_tokens=3))
    scheduler.add(group("i-score", 5, max_tokens=0))
    assert scheduler.has_interactive_work and scheduler.should_pause(lines)
    plan = scheduler.schedule()  # i-gen's prompt in chunks: b-gen decodes beside it; the pass goes on
    assert chunks(plan) == [("i-gen", 32)] and plan.prompt_pass is lines and names(plan.decode) == ["b-gen"]
    run(scheduler, plan, paused=True)
    plan = scheduler.schedule()  # i-score's own pass, instead of the batch pass, this step
    assert chunks(plan) == [("i-gen", 8)] and names(plan.score) == ["i-score"] and names(plan.decode) == ["b-gen"]
    assert plan.prompt_pass.steps is None and scheduler.passes == [lines, plan.prompt_pass]
    run(scheduler, plan)
    plan = scheduler.schedule()
    assert names(plan.decode) == ["b-gen", "i-gen"] and not plan.prefill and plan.prompt_pass is lines
    run(scheduler, plan, paused=True)
    while scheduler.has_interactive_work:
        assert scheduler.should_pause(lines)
        plan = scheduler.schedule()
        assert plan.prompt_pass is lines and not any(c.group.is_batch for c in plan.prefill)
        assert any(not g.is_batch for g in plan.decode)
        run(scheduler, plan, paused=True)
    assert not scheduler.should_pause(lines)  # b-gen still decodes, but in the steps around the pass
    run(scheduler, scheduler.schedule())  # the pass's last step
    assert not scheduler.passes
    plan = scheduler.schedule()  # the batch groups go on where they were
    assert names(plan.decode) == ["b-gen"] and chunks(plan) == [("b-long", 16)]


def test_prompts_admitted_beside_a_scoring_pass():
    """A step while an interactive prompt-only pass is begun (`_beside_interactive_pass`): the
    interactive generations' prompts are admitted past the prompt-only groups queued ahead of them, and
    get a chunk; the prompt-only and batch groups stay queued in their order; the running rows decode
    there once the pass has run `score_batch_tokens_decoding` padded tokens since they last decoded."""
    scheduler = Scheduler(SchedulerSettings(score_batch_tokens_decoding=512), prefill_chunk_tokens=8, interleaves=True)
    running = group("running", 3, max_tokens=10)
    scheduler.add(running)
    run(scheduler, scheduler.schedule())
    assert names(scheduler.running) == ["running"]
    for made in (group("score1", 300, max_tokens=0), group("score2", 300, max_tokens=0), group("stream", 20),
                 batch("line", 5), group("score3", 300, max_tokens=0)):
        scheduler.add(made)
    outer = scheduler.schedule()  # the pass of score1 alone (two would pass the budget), the running row
    scoring = outer.prompt_pass
    assert names(outer.score) == ["score1"] and names(outer.decode) == ["running"] and not outer.prefill
    run(scheduler, outer, paused=True)
    assert names(scheduler.waiting) == ["score2", "stream", "score3", "line"] and scheduler.has_prompts_to_admit
    assert scheduler.should_pause(scoring)
    plan = scheduler.schedule()
    assert chunks(plan) == [("stream", 8)] and plan.prompt_pass is scoring and not (plan.decode or plan.trees)
    assert "stream" not in names(scheduler.waiting) and names(scheduler.prefilling) == ["stream"]
    assert names(scheduler.waiting) == ["score2", "score3", "line"]
    scoring.tokens = 512  # the pass ran that many padded tokens: the running rows are due a step
    plan = scheduler.schedule()
    assert chunks(plan) == [("stream", 8)] and names(plan.decode) == ["running"] and scoring.tokens == 0
    assert chunks(scheduler.schedule()) == [("stream", 4)]
    scheduler.prefilled(scheduler.prefilling[0])
    assert not scheduler.has_prompts_to_admit and not scheduler.should_pause(scoring)
    assert names(scheduler.running) == ["running", "stream"]
    scoring.tokens = 600
    assert scheduler.should_pause(scoring)
    plan = scheduler.schedule()  # no prompt: the running rows alone, beside the pass
    assert names(plan.decode) == ["running", "stream"] and not plan.prefill and plan.prompt_pass is scoring


def test_no_prompt_to_admit_leaves_the_queue_as_it_is():
    scheduler = Scheduler(prefill_chunk_tokens=8, interleaves=True)
    scoring = begun(scheduler, group("scoring", 30, max_tokens=0))
    for made in (group("score1", 30, max_tokens=0), batch("line", 5)):
        scheduler.add(made)
    assert not scheduler.has_prompts_to_admit and not scheduler.should_pause(scoring)
    plan = scheduler.schedule()
    assert plan.prompt_pass is scoring and not (plan.prefill or plan.decode)
    assert names(scheduler.waiting) == ["score1", "line"]


def test_a_plan_names_the_prompts_whose_edits_are_made_before_their_first_pass():
    """A prompt with interventions whose edits are not made yet is an item of the plan that starts it
    (Plan.edits: the engine makes them first, a clean pass per patch); once made, later plans leave it out."""
    from logprobe.backend import Intervention

    scheduler = Scheduler(prefill_chunk_tokens=4)
    edited = SequenceGroup("edited", list(range(1, 11)), SamplingParams(
        max_tokens=2, interventions=[Intervention(layer=1, op="patch", positions=(0,), source_ids=(1, 2))]), TABLE)
    plain = group("plain", 3)
    scheduler.add(plain)
    scheduler.add(edited)
    plan = scheduler.schedule()
    assert names(plan.edits) == ["edited"] and edited in [c.group for c in plan.prefill]
    edited.edits = object()  # made
    run(scheduler, plan)
    plan = scheduler.schedule()
    assert edited in plan.groups and plan.edits == []
    late = SequenceGroup("late", [1, 2, 3], SamplingParams(
        max_tokens=0, interventions=[Intervention(layer=1, op="patch", positions=(0,), source_ids=(1, 2))]), TABLE)
    scheduler.add(late)
    plan = scheduler.schedule()
    assert names(plan.edits) == ["late"] and names(plan.score) == ["late"]
    late.error = RuntimeError("its edits failed")
    plan.drop_failed()
    assert late not in plan.groups and plan.score == []
