"""The pytest plugin that runs graded tests on one rank and reports each one as it ends.

Around every test it

1. waits at a store barrier until every rank is there (so a slow rank is
   never mistaken for a hung one by the process group's short timeout),
2. creates a fresh default process group: a message a previous test sent and
   never received cannot reach this one,
3. guards the built-in collectives if the part forbids them,
4. after the test, destroys the group and appends one ``end`` record with
   the rank's outcome and the first thing a student should fix.

The supervisor, not this plugin, decides the test's verdict: a rank that
never writes its ``end`` record has not passed.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from grader import protocol
from grader.protocol import PlannedTest, ReportWriter
from grader.rank import context, forbid
from grader.rank.context import SubmissionImportError, TestContext
from grader.rank.frames import is_student_file, student_frames
from grader.rank.p2p import CommunicationTimeout, PeerGone

_BARRIER_TIMEOUT = datetime.timedelta(hours=1)  # the supervisor's watchdog ends real hangs


class RankHarness:
    def __init__(
        self,
        tests: list[PlannedTest],
        store: dist.Store,
        rank: int,
        world_size: int,
        backend: str,
        device: torch.device,
        report: ReportWriter,
        attempt: int,
        job_dir: Path,
    ) -> None:
        self.tests = {t.nodeid: t for t in tests}
        self.order = [t.nodeid for t in tests]
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self.report = report
        self.attempt = attempt
        self.job_dir = job_dir
        self._skipped = False
        self._outcome: tuple[str, str, dict[str, Any]] | None = None
        self._group_error: Exception | None = None

    # -- collection: run exactly the planned tests, in the planned order ---------------

    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        by_id = {item.nodeid: item for item in items}
        items[:] = [by_id[nodeid] for nodeid in self.order if nodeid in by_id]

    # -- one test -----------------------------------------------------------------------

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Any:
        test = self.tests[item.nodeid]
        self.report.write("start", test=test.id, time=time.time())
        self._outcome = None
        ctx = TestContext(
            test, self.rank, self.world_size, self.device, self.report, self._barrier_for(test)
        )
        self._group_error = None
        self._skipped = False
        try:
            self._skipped = self._agree_to_skip(test)
            if not self._skipped:
                self._fresh_group(test)
        except Exception as err:  # a peer that died between tests
            self._group_error = err
            self._outcome = (protocol.ERROR, f"could not form the process group: {err}", {})
        if self._skipped:
            self._outcome = (protocol.NOT_RUN, "skipped: its verdict is already known", {})
        context.set_current(ctx)
        if test.forbid_collectives:
            forbid.activate()
        try:
            yield
        finally:
            violations = forbid.deactivate()
            context.set_current(None)
            outcome, message, extra = self._outcome or (protocol.PASSED, "", {})
            if violations:
                outcome, message = protocol.FORBIDDEN, violations[0]
            self.report.write(
                "end",
                test=test.id,
                time=time.time(),
                outcome=outcome,
                message=message,
                extra={**ctx.extra, **extra},
            )
            # After the report: gloo may abort the process while tearing down a group that
            # a test broke, and a rank that dies between tests costs no test its verdict.
            if dist.is_initialized():
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if self._group_error is not None:
            raise self._group_error
        if self._skipped:
            pytest.skip("its verdict is already known")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, Any, None]:
        outcome = yield
        report: pytest.TestReport = outcome.get_result()
        if report.failed and self._outcome is None:
            self._outcome = classify(call.excinfo, report)

    def _agree_to_skip(self, test: PlannedTest) -> bool:
        """Whether the supervisor asked to skip ``test`` (say, a cost test of a function
        that already failed), decided by rank 0 for all: a test run by some ranks only
        would hang the others."""
        key = f"attempt{self.attempt}/{test.id}/skip"
        self._store_barrier(key + "/arrived")
        if self.rank == 0:
            self.store.set(key, "1" if test.id in protocol.read_skips(self.job_dir) else "0")
        return self.store.get(key) == b"1"

    def _fresh_group(self, test: PlannedTest) -> None:
        prefix = f"attempt{self.attempt}/{test.id}/"
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(prefix, self.store),
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=test.op_timeout),
        )

    def _barrier_for(self, test: PlannedTest) -> Callable[[], None]:
        """A barrier through the store, not a collective: usable where collectives are forbidden."""
        count = 0

        def barrier() -> None:
            nonlocal count
            count += 1
            self._store_barrier(f"attempt{self.attempt}/{test.id}/barrier{count}")

        return barrier

    def _store_barrier(self, key: str) -> None:
        if self.store.add(key, 1) == self.world_size:
            self.store.set(key + "/all", "1")
        self.store.wait([key + "/all"], _BARRIER_TIMEOUT)


def classify(
    excinfo: pytest.ExceptionInfo[BaseException] | None, report: pytest.TestReport
) -> tuple[str, str, dict[str, Any]]:
    """Turn how a test failed on this rank into (outcome, message, extra)."""
    if excinfo is None:
        return protocol.ERROR, report.longreprtext.strip().splitlines()[-1], {}
    err = excinfo.value
    frames = student_frames(excinfo.tb)
    at = f" (at {frames[-1]})" if frames else ""
    if isinstance(err, forbid.ForbiddenCall):
        return protocol.FORBIDDEN, str(err), {}
    if isinstance(err, CommunicationTimeout):
        return protocol.TIMEOUT, str(err), {"waiting_for": _peer(err.peer)}
    if isinstance(err, PeerGone):
        return protocol.ERROR, str(err), {"peer_gone": True, "waiting_for": _peer(err.peer)}
    if isinstance(err, SubmissionImportError):
        return protocol.ERROR, str(err), {}
    if isinstance(err, NotImplementedError) and frames:
        return (
            protocol.FAILED,
            f"not implemented yet: {_raiser(excinfo)} raises NotImplementedError",
            {},
        )
    if isinstance(err, AssertionError):
        return protocol.FAILED, str(err).split("\nassert ")[0].strip() or "assertion failed", {}
    detail = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return protocol.ERROR, f"{type(err).__name__}: {detail}{at}".strip(), {}


def _peer(rank: int) -> int | None:
    return rank if rank >= 0 else None


def _raiser(excinfo: pytest.ExceptionInfo[BaseException]) -> str:
    """The qualified name (with its class) of the innermost student function in a traceback."""
    name = ""
    tb = excinfo.tb
    while tb is not None:
        code = tb.tb_frame.f_code
        if is_student_file(code.co_filename):
            name = getattr(code, "co_qualname", code.co_name)
        tb = tb.tb_next
    return name
