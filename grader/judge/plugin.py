"""The pytest plugin that runs the graded tests in the grader's own process and judges them.

The graded tests are trusted code: they make the inputs (from a seed the
ranks never see), drive the ranks through :class:`World`, and compare what
comes back. This plugin gives them their fixtures and turns each test's
report into a :class:`Verdict`. It is the one place where verdicts are made,
and it fails closed: a test passes only if its every phase passed; a skip,
an xfail, an interrupt or anything unexpected is not a pass.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from grader import failures, protocol
from grader.course.catalog import GradedTest
from grader.course.options import OptionError, TestOptions
from grader.failures import Cause
from grader.judge.verdict import Schedule, Verdict
from grader.launch.world import CallLimits, RankPool, World
from grader.testkit.compare import WrongResult
from grader.testkit.record import PartialCredit, TestRecord

OnStart = Callable[[GradedTest], None]
OnVerdict = Callable[[GradedTest, Verdict], None]


@dataclass
class _Running:
    test: GradedTest
    record: TestRecord
    started: float
    failure: Verdict | None = None
    phases_passed: set[str] = field(default_factory=set)


class GradingPlugin:
    def __init__(
        self,
        tests: list[GradedTest],
        pool: RankPool,
        on_start: OnStart,
        on_verdict: OnVerdict,
        reference_pool: RankPool | None = None,
    ) -> None:
        """``pool``: the submission's ranks; ``reference_pool``: the reference's own, apart
        from the student's, which cannot reach them: the performance tests time its local
        work beside the student's. The plugin uses them; whoever made them closes them."""
        self.tests = {t.nodeid: t for t in tests}
        self.on_start = on_start
        self.on_verdict = on_verdict
        self.pool = pool
        self.reference_pool = reference_pool
        self._running: _Running | None = None
        self.grader_failure: str | None = None

    def pytest_configure(self, config: pytest.Config) -> None:
        # A verdict is made from the exception itself (_verdict_of_failure), never from
        # pytest's text of a failure. The long form of that text parses the source of every
        # frame of the traceback: some 60 ms a failed test, most of a failing submission's
        # grading. Its "no" form is the exception's own line.
        config.option.tbstyle = "no"

    # -- fixtures of the graded tests ----------------------------------------------------

    @pytest.fixture
    def grading(self) -> GradingPlugin:
        """The running grader, from which ``world`` (tests/graded/conftest.py) gets its ranks."""
        return self

    def world_for(self, world_size: int) -> World:
        """The ranks of this test's world size, bound by this test's rules."""
        return World(world_size, self.pool, self._limits())

    def reference_for(self, world_size: int) -> World | None:
        """The reference's ranks of this world size, bound by this test's rules; None where
        there is no reference to run (a student's release, a run across nodes)."""
        if self.reference_pool is None:
            return None
        return World(world_size, self.reference_pool, self._limits())

    def _limits(self) -> CallLimits:
        assert self._running is not None
        settings = self._running.test.settings
        return CallLimits(settings.timeout, settings.forbid_collectives)

    @pytest.fixture
    def options(self) -> TestOptions:
        """The test's ``options`` from grading.yaml (sizes, thresholds), checked at load."""
        assert self._running is not None
        return self._running.test.settings.options

    @pytest.fixture
    def record(self) -> TestRecord:
        """Figures, partial credit and schedules the test reports beside its outcome."""
        assert self._running is not None
        return self._running.record

    # -- collection: exactly the selected tests, one world size after the other ------------

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        order = {nodeid: i for i, nodeid in enumerate(self.tests)}
        kept = [item for item in items if item.nodeid in order]
        kept.sort(key=lambda item: (self.tests[item.nodeid].world_size, order[item.nodeid]))
        items[:] = kept

    # -- one test ------------------------------------------------------------------------

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Iterator:
        test = self.tests[item.nodeid]
        self._running = _Running(test, TestRecord(), time.monotonic())
        self.on_start(test)
        outcome = yield
        running, self._running = self._running, None
        if outcome.excinfo is not None and issubclass(outcome.excinfo[0], KeyboardInterrupt):
            return  # interrupted: no verdict; the grader reports the test as not run
        self._conclude(running)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator:
        outcome = yield
        report: pytest.TestReport = outcome.get_result()
        running = self._running
        if running is None:
            return
        if report.passed and not hasattr(report, "wasxfail"):
            running.phases_passed.add(report.when)
        elif running.failure is None:
            verdict = self._verdict_of_failure(call, report)
            err = call.excinfo.value if call.excinfo is not None else None
            running.failure = replace(verdict, check=verdict.check or check_of(err, item.path))
            if self.grader_failure is not None:  # e.g. no job starts: the run ends, exit 2
                item.session.shouldstop = self.grader_failure

    def _verdict_of_failure(
        self, call: pytest.CallInfo[None], report: pytest.TestReport
    ) -> Verdict:
        err = call.excinfo.value if call.excinfo is not None else None
        record = self._running.record if self._running else TestRecord()
        if isinstance(err, failures.GraderFailure | OptionError):  # never the student's doing
            self.grader_failure = (
                str(err)
                if isinstance(err, failures.GraderFailure)
                else (f"the course's configuration: {err}")
            )
            return Verdict(protocol.ERROR, protocol.clean(self.grader_failure), cause=Cause.GRADER)
        if isinstance(err, failures.RankFailure):
            message, case = protocol.clean(str(err)), protocol.clean(err.case)
            return Verdict(err.outcome, message, case=case, cause=err.cause, check=err.check)
        if isinstance(err, PartialCredit):
            message = protocol.clean(str(err))
            return Verdict(protocol.FAILED, message, fraction=record.fraction, cause=Cause.COST)
        if isinstance(err, AssertionError):
            # The graded tests run with --assert=plain: the message is the test's own.
            message = protocol.clean(str(err).strip() or "assertion failed")
            cause = Cause.WRONG_RESULT if isinstance(err, WrongResult) else Cause.CHECK
            return Verdict(protocol.FAILED, message, cause=cause)
        if report.skipped:
            message = "the test was skipped: a skipped test earns nothing"
            return Verdict(protocol.ERROR, message, cause=Cause.SKIPPED)
        if err is None:
            return Verdict(protocol.ERROR, "the test did not complete", cause=Cause.GRADER)
        # An exception of the test's own code: a value from the ranks it could not use.
        message = protocol.clean(f"{type(err).__name__}: {err}")
        return Verdict(protocol.ERROR, message, cause=Cause.CHECK)

    def _conclude(self, running: _Running) -> None:
        test, record = running.test, running.record
        seconds = time.monotonic() - running.started
        schedule = Schedule(*record.schedule) if record.schedule else None
        if running.failure is not None:
            verdict = running.failure
        elif {"setup", "call", "teardown"} <= running.phases_passed:
            verdict = Verdict(protocol.PASSED, record.message, fraction=record.fraction)
        else:
            verdict = Verdict(protocol.ERROR, "the test did not complete", cause=Cause.GRADER)
        self.on_verdict(
            test,
            replace(
                verdict,
                details=dict(record.details),
                schedule=schedule,
                ring=record.ring,
                seconds=seconds,
            ),
        )


def check_of(err: BaseException | None, test_file: Path) -> str:
    """The name of the check that failed, where the graded test's own code raised it (its file
    and line): the same check at every world size and in every test it serves."""
    if err is None or isinstance(err, failures.RankFailure):
        return ""  # the call failed, not a check of the test's: its cause says what it is
    lines = [
        n for f, n in traceback.walk_tb(err.__traceback__) if f.f_code.co_filename == str(test_file)
    ]
    return f"{test_file.name}:{lines[-1]}" if lines else ""
