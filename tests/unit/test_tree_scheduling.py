"""Token trees in the scheduler (engine/host/scheduler.py), on made-up groups with no model: a tree grows a level
in every step beside the other work, never waits behind the queue, and leaves when finished or aborted."""

from __future__ import annotations

import numpy as np

from fake_backend import TinyTokenizer
from logprobe.backend import SamplingParams, TreeShape
from logprobe.engine.host.request import SequenceGroup
from logprobe.engine.host.scheduler import Scheduler
from logprobe.engine.host.tree import Children, TreeGroup
from logprobe.tokens import TokenTable

TABLE = TokenTable.build(TinyTokenizer(), 258)


def tree(name: str, depth: int = 2) -> TreeGroup:
    return TreeGroup(name, [1, 2, 3], SamplingParams(max_tokens=depth), TABLE, TreeShape(depth, 2))


def grow(group: TreeGroup) -> None:
    """A level of two children under each frontier node, as a pass would record them."""
    rows = len(group.frontier)
    group.grow(Children(np.full(rows, 2), np.tile([65, 66], (rows, 1)), np.full((rows, 2), -1.0, np.float32),
                        np.full((rows, 2), -1.0, np.float32), np.tile([1, 2], (rows, 1)),
                        np.full(rows, 0.5, np.float32)))


def test_a_tree_grows_beside_the_other_work_until_done():
    scheduler = Scheduler()
    first = tree("t1")
    scheduler.add(SequenceGroup("g", [1, 2], SamplingParams(max_tokens=4), TABLE))
    scheduler.add(first)
    assert scheduler.has_work and scheduler.num_in_flight == 2
    plan = scheduler.schedule()
    assert plan.trees == [first] and [c.group.request_id for c in plan.prefill] == ["g"]
    assert first in plan.groups and plan.num_rows == 2
    for _ in range(2):  # the prompt's pass, then the first level's
        grow(first)
    assert first.is_finished and first.num_nodes == 2 + 4
    scheduler.finished(first)
    assert scheduler.schedule().trees == []


def test_an_aborted_tree_is_dropped():
    scheduler = Scheduler()
    doomed, kept = tree("t1"), tree("t2")
    scheduler.add(doomed)
    scheduler.add(kept)
    doomed.is_aborted = True
    assert scheduler.schedule().trees == [kept]
    assert scheduler.take_dropped() == [doomed]
    scheduler.finished(kept)
    assert scheduler.schedule() is None and not scheduler.has_work
