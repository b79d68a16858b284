"""Scoring datasets: many texts' log probabilities, in process or on running servers (docs/datasets.md).

`score(...)` for notebooks; `io.read_rows`, `scorer.InProcessScorer` / `scorer.RemoteScorer` and
`job.run` are what `logprobe score --input` is built from.
"""

from __future__ import annotations


def score(*args, **kwargs):
    """See `logprobe.datasets.api.score`."""
    from .api import score as _score  # pyarrow (the data extra) loads with the first call

    return _score(*args, **kwargs)
