"""Each test imports the submission anew (``grader/rank/worker.py``): nothing its modules keep
passes from one test to the next, so a grade never depends on which tests ran before it.

One job of ranks serves every test of a grading; a world serves one test, and its first call
drops every module of the submission on every rank before it runs. Within a test, the
modules keep their state from call to call, as in any program. What lies outside the
submission's modules (here, a mark on ``torch``) is not reset: a rank's process lives for
the whole grading.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from runner import SUBMISSIONS

from grader import sandbox
from grader.course.submission import stage
from grader.launch.job import job_settings
from grader.launch.world import CallLimits, RankPool, World

CALLS = "collectives.calls_since_import"


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RankPool]:
    work = tmp_path_factory.mktemp("fresh")
    stage(SUBMISSIONS / "state_between_tests", work / "import")
    pool = RankPool(2, job_settings(work, sandbox.detect("auto"), "cpu"))
    yield pool
    pool.close()


def test_each_test_imports_the_submission_and_its_helpers_anew(pool: RankPool) -> None:
    first = World(2, pool, CallLimits(timeout=60))
    assert first.call(CALLS, [()] * 2).returned == [[1, 1, False]] * 2
    assert first.call(CALLS, [()] * 2).returned == [[2, 2, True]] * 2  # within a test: kept
    second = World(2, pool, CallLimits(timeout=60))  # the next test, on the same ranks
    assert second.call(CALLS, [()] * 2).returned == [[1, 1, True]] * 2


def test_a_test_at_another_world_size_imports_anew_too(pool: RankPool) -> None:
    World(2, pool, CallLimits(timeout=60)).call(CALLS, [()] * 2)
    alone = World(1, pool, CallLimits(timeout=60))
    assert alone.call(CALLS, [()]).returned[0][:2] == [1, 1]
