"""The dataset scorer's wide prompt-only passes (scorer.PASS_ROWS rows, the scheduler's token budget still
bounding them): short rows share passes of more than the engine's default 64 rows, every number equals
the float64 reference, and every row's record is, bit for bit, what passes of at most 64 rows give it: a
dataset's scores do not depend on how its rows were batched."""

from __future__ import annotations

import numpy as np
import pytest

from logprobe.datasets import job
from logprobe.datasets.columns import ScoreOptions
from logprobe.datasets.io import Row
from logprobe.datasets.scorer import PASS_ROWS, InProcessScorer

TOL = 1e-5
WORDS = "the cat sat on a mat and then ran off to see dog bird tree house".split()


def short_rows(count: int) -> list[Row]:
    """Rows of 1 to 4 words: many fit one pass's token budget."""
    rng = np.random.default_rng(7)
    return [Row(i, f"r{i}", " ".join(rng.choice(WORDS, size=1 + i % 4))) for i in range(count)]


def score(engine, rows: list[Row], max_rows: int) -> tuple[list[dict], list[int]]:
    """Records of `rows` in the job's chunks with passes of at most `max_rows` rows, and the passes' sizes."""
    scorer = InProcessScorer(engine, ScoreOptions(top=3, tokens=True))
    batches, sizes = engine.runner.prompt_batches, []
    old_rows, plain = engine.scheduler.max_score_batch, batches.run_plain

    def run_plain(groups, *head):
        sizes.append(len(groups))
        return plain(groups, *head)  # the pass's steps

    engine.scheduler.max_score_batch, batches.run_plain = max_rows, run_plain  # on the instance only
    try:
        prepared = scorer.prepare(rows)
        records = {}
        job.run_sync(job.score_chunks(scorer, job.chunks(prepared),
                                      lambda chunk, got: records.update(zip((p.row.id for p in chunk), got))))
    finally:
        engine.scheduler.max_score_batch = old_rows
        del batches.run_plain  # the class's method again
    return [records[r.id] for r in rows], sizes


@pytest.mark.parametrize("rows", [short_rows(400)], ids=["400 short rows"])
def test_wide_passes_equal_reference_and_narrow(tiny_engine, reference, rows):
    wide, wide_sizes = score(tiny_engine, rows, PASS_ROWS)
    narrow, narrow_sizes = score(tiny_engine, rows, 64)
    assert max(narrow_sizes) <= 64 < max(wide_sizes)
    bos = tiny_engine.info.bos_token_id
    assert wide == narrow  # every record, every number: the same bits
    for got in wide:
        ids = got["token_ids"]
        ref = reference.logprobs([bos] + ids)[:-1]  # row j predicts ids[j]
        want = ref[range(len(ids)), ids].numpy()
        np.testing.assert_allclose(got["token_logprobs"], want, atol=TOL, err_msg=got["id"])
        top = np.sort(ref.numpy(), axis=-1)[:, ::-1][:, :3]
        np.testing.assert_allclose(got["top_logprobs"], top, atol=TOL, err_msg=got["id"])
        for j, (rank, token) in enumerate(zip(got["ranks"], ids)):
            low, high = reference.rank_bounds(ref[j], token)
            assert low <= rank <= high
