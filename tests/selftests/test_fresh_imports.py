"""Each test starts the submission afresh (``grader/rank/fresh.py``): nothing it keeps in its
modules, the import system or the builtins passes from one test to the next, and its random
draws are the same in every test, so a grade never depends on which tests ran before it.

One job of ranks serves every test of a grading; a world serves one test, and its first call
puts every rank back as it was before the submission first ran. Within a test, the
submission keeps its state from call to call, as in any program. What lies outside (here, a
mark on ``torch``) is not put back: a rank's process lives for the whole grading, and only a
submission set on keeping state reaches there.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from runner import SUBMISSIONS

from grader import sandbox
from grader.course.submission import stage
from grader.device import Device
from grader.launch.job import job_settings
from grader.launch.world import CallLimits, RankPool, World

CALLS = "collectives.calls_since_import"
FIRST, SECOND = [1] * 5, [2] * 5  # each place's count of calls, in a test's first two


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fresh")


@pytest.fixture(scope="module")
def pool(work: Path) -> Iterator[RankPool]:
    stage(SUBMISSIONS / "state_between_tests", work / "import")
    pool = RankPool(2, job_settings(work, sandbox.detect(), Device.CPU))
    yield pool
    pool.close()


def test_each_test_starts_the_submission_afresh(pool: RankPool) -> None:
    first = World(2, pool, CallLimits(timeout=60))
    (counts, draws, marked), _ = first.call(CALLS, [()] * 2).returned
    assert (counts, marked) == (FIRST, False)
    (counts, later_draws, marked), _ = first.call(CALLS, [()] * 2).returned
    assert (counts, marked) == (SECOND, True)  # within a test: kept
    assert later_draws != draws
    second = World(2, pool, CallLimits(timeout=60))  # the next test, on the same ranks
    assert second.call(CALLS, [()] * 2).returned[0] == [FIRST, draws, True]


def test_a_test_at_another_world_size_starts_afresh_too(pool: RankPool) -> None:
    World(2, pool, CallLimits(timeout=60)).call(CALLS, [()] * 2)
    alone = World(1, pool, CallLimits(timeout=60))
    assert alone.call(CALLS, [()]).returned[0][0] == FIRST


def test_a_module_put_in_place_of_a_library_one_is_dropped(pool: RankPool) -> None:
    """The worker judges each library module once; one put in its place is judged anew."""
    first = World(2, pool, CallLimits(timeout=60))
    assert first.call("collectives.import_library", [()] * 2).returned == [False, False]
    second = World(2, pool, CallLimits(timeout=60))  # its start finds the library's module
    assert second.call("collectives.in_place_of_library", [()] * 2).returned == [1, 1]
    assert second.call("collectives.in_place_of_library", [()] * 2).returned == [2, 2]
    third = World(2, pool, CallLimits(timeout=60))
    assert third.call("collectives.in_place_of_library", [()] * 2).returned == [1, 1]


def test_a_file_whose_text_changed_is_compiled_anew(pool: RankPool, work: Path) -> None:
    """A rank compiles each file of the submission once for the same text (``CompiledOnce``),
    and runs it afresh in every test: a staged file changed between two tests runs as it
    now reads, and as it read before once its text is back."""
    staged = work / "import" / "assignments" / "helper.py"
    before = staged.read_text()
    World(2, pool, CallLimits(timeout=60)).call(CALLS, [()] * 2)
    staged.chmod(0o644)
    try:
        staged.write_text(before.replace("calls = 0", "calls = 40"))
        changed = World(2, pool, CallLimits(timeout=60))
        assert [counts[1] for counts, *_ in changed.call(CALLS, [()] * 2).returned] == [41, 41]
    finally:
        staged.write_text(before)
    again = World(2, pool, CallLimits(timeout=60))
    assert [counts[1] for counts, *_ in again.call(CALLS, [()] * 2).returned] == [1, 1]
