"""Every runnable example in README.md and docs/**/*.md, run against a real `logprobe serve` on the
bundled model (the convention: tests/doc_examples.py).

Slow: some examples score datasets in processes of their own, each loading the model."""

from __future__ import annotations

import pytest

from doc_examples import collect, run_example

pytestmark = pytest.mark.e2e

EXAMPLES, ERRORS = collect()


@pytest.mark.parametrize("example", [pytest.param(ex, id=ex.name) for ex in EXAMPLES])
def test_doc_example(example, server):
    failure = run_example(example, server)
    if failure:
        pytest.fail(failure, pytrace=False)


def test_docs_have_examples():
    """The check never passes for want of examples, nor with examples lost to a malformed marker."""
    assert EXAMPLES, "no <!-- example: NAME --> block found in README.md or docs/**/*.md"
    assert not ERRORS, "doc example markers:\n" + "\n".join(ERRORS)
