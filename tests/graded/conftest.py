"""The graded tests run in the grader's own process and drive the ranks; see grader.testkit.

A graded test is an ordinary pytest function marked with what it grades::

    @pytest.mark.graded(target="collectives.all_reduce", kind="correctness")
    def test_all_reduce(world): ...

Its fixtures come from the grader (grader/judge/plugin.py): ``world`` (the
ranks of one world size; the test runs once per world size in grading.yaml),
``world_size``, ``reference`` (the reference's ranks in a job of their own, to
time the submission against), ``options`` (the test's ``TestOptions``:
grading.yaml's ``options:``, typed and checked when it loads:
grader/course/options.py) and ``record`` (figures, partial credit, schedules).
Its points, world sizes and time limits come from ``grading.yaml``. It fails
with an ``AssertionError`` whose message is the first thing a student should fix.
"""

from __future__ import annotations

import pytest

from grader.testkit import World


@pytest.fixture
def world(world_size: int, grading) -> World:
    """The ranks of one world size; the test runs once per world size in grading.yaml."""
    return grading.world_for(world_size)


@pytest.fixture
def reference(world_size: int, grading) -> World | None:
    """The reference's ranks of the same world size, in a job of their own, for a test that
    times the submission against it; None where there is no reference to run."""
    return grading.reference_for(world_size)
