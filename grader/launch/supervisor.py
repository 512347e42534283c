"""Runs the tests of one world size in torchrun jobs until every test has a verdict.

One job runs every test of a world size, one after the other, because a job
costs seconds to start. The supervisor reads the ranks' reports as they are
written and keeps a watchdog on the test each rank is in. When a rank dies or
hangs, the test it was in gets its verdict (``crashed`` or ``timeout``, with
where each stuck rank was), the job is killed whole, and a new job resumes at
the next test. A submission can cost itself points, never the grader a verdict.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grader import protocol
from grader.catalog import GradedTest
from grader.judge.costs import must_pass_first
from grader.judge.stacks import read_dump, student_stack
from grader.judge.verdict import RankResult, Verdict, judge
from grader.launch.job import TorchrunJob, log_tail, process_alive
from grader.rank.p2p import read_waiting

_POLL_SECONDS = 0.05
_SETTLE_SECONDS = 0.4  # for stacks to be dumped, and peers of a dead rank to report
# A rank still in a test this long after its last peer left it, beyond the
# process group's own timeout (which ends every wait in communication), is stuck.
_GRACE_AFTER_PEERS_SECONDS = 3.0

OnVerdict = Callable[[GradedTest, Verdict], None]
OnStart = Callable[[GradedTest], None]


@dataclass
class _TestWatch:
    test: GradedTest
    results: dict[int, RankResult] = field(default_factory=dict)
    started: dict[int, float] = field(default_factory=dict)  # rank -> supervisor clock
    ended: dict[int, float] = field(default_factory=dict)
    importing: set[int] = field(default_factory=set)
    module: str = ""

    def open_ranks(self) -> list[int]:
        return sorted(set(self.started) - set(self.results))

    def seconds(self) -> float:
        return time.monotonic() - min(self.started.values()) if self.started else 0.0

    def deadline(self, rank: int, world_size: int) -> float:
        settings = self.test.settings
        deadline = self.started[rank] + settings.timeout
        if self.ended and len(self.ended) == world_size - 1:  # every peer has left the test
            after_peers = settings.op_timeout + _GRACE_AFTER_PEERS_SECONDS
            deadline = min(deadline, max(self.ended.values()) + after_peers)
        return deadline


class _JobRun:
    """The state of one job as its ranks' reports tell it."""

    def __init__(self, tests: list[GradedTest], world_size: int, job_dir: Path) -> None:
        self.world_size = world_size
        self.job_dir = job_dir
        self.watches = {t.id: _TestWatch(t) for t in tests}
        self.readers = {
            r: protocol.ReportReader(protocol.report_path(job_dir, r)) for r in range(world_size)
        }
        self.pids: dict[int, int] = {}
        self.finished: set[int] = set()
        self.current: dict[int, str] = {}  # rank -> the test it is in
        self.judged: set[str] = set()

    def read(self, on_start: OnStart) -> None:
        for rank, reader in self.readers.items():
            for record in reader.new_records():
                self._apply(rank, record, on_start)

    def _apply(self, rank: int, record: dict[str, Any], on_start: OnStart) -> None:
        event = record.get("event")
        if event == "ready":
            self.pids[rank] = int(record["pid"])
        elif event == "finished":
            self.finished.add(rank)
        watch = self.watches.get(record.get("test", ""))
        if watch is None:
            return
        now = time.monotonic()
        if event == "start":
            if not watch.started:
                on_start(watch.test)
            watch.started[rank] = now
            self.current[rank] = watch.test.id
        elif event == "importing":
            watch.importing.add(rank)
            watch.module = record.get("module", "")
        elif event == "imported":
            watch.importing.discard(rank)
        elif event == "end":
            watch.importing.discard(rank)
            watch.ended[rank] = now
            watch.results[rank] = RankResult(
                record.get("outcome", protocol.ERROR),
                record.get("message", ""),
                record.get("extra") or {},
            )
            self.current.pop(rank, None)

    def complete(self) -> list[_TestWatch]:
        return [
            w
            for w in self.watches.values()
            if w.test.id not in self.judged and len(w.results) == self.world_size
        ]

    def dead_ranks(self) -> list[int]:
        return sorted(
            r for r, pid in self.pids.items() if r not in self.finished and not process_alive(pid)
        )

    def stuck_ranks(self) -> list[int]:
        now = time.monotonic()
        return sorted(
            rank
            for rank, test_id in self.current.items()
            if now > self.watches[test_id].deadline(rank, self.world_size)
        )


@dataclass
class SupervisorSettings:
    import_dir: Path
    work_dir: Path


class Supervisor:
    """Grades the tests of one world size after another; see the module docstring."""

    def __init__(
        self, settings: SupervisorSettings, on_verdict: OnVerdict, on_start: OnStart | None = None
    ) -> None:
        self.settings = settings
        self.on_verdict = on_verdict
        self.on_start = on_start or (lambda test: None)
        # A part whose import ends or hangs the process is not imported again.
        self.poisoned: dict[str, tuple[str, str]] = {}
        # Cost tests of a function that failed its correctness test: not worth running.
        self.skips: set[str] = set()
        self._jobs = 0

    def run(self, tests: list[GradedTest], world_size: int, backend: str) -> None:
        remaining = list(tests)
        while remaining:
            remaining = self._skip_poisoned(remaining)
            if not remaining:
                return
            self._jobs += 1
            job_dir = self.settings.work_dir / f"ws{world_size}-job{self._jobs}"
            job_dir.mkdir(parents=True)
            judged = self._run_job(remaining, world_size, backend, job_dir)
            if not judged:  # the job never got going: nothing of the student's is to blame
                message = _launch_failure(job_dir)
                for test in remaining:
                    self.on_verdict(
                        test, Verdict(protocol.ERROR, message, {"grader_failure": True})
                    )
                return
            remaining = [t for t in remaining if t.id not in judged]

    def _run_job(
        self, tests: list[GradedTest], world_size: int, backend: str, job_dir: Path
    ) -> set[str]:
        self._plan(tests, backend).write(job_dir)
        protocol.write_skips(job_dir, self.skips)
        run = _JobRun(tests, world_size, job_dir)
        with TorchrunJob(job_dir, world_size) as job:
            while True:
                run.read(self.on_start)
                job.worker_pids.update(run.pids.values())
                for watch in run.complete():
                    self._conclude(run, watch, judge(watch.results, world_size, watch.seconds()))
                if len(run.judged) == len(tests) or len(run.finished) == world_size:
                    break
                dead = run.dead_ranks()
                if dead or not job.running():
                    self._after_death(run, dead or sorted(set(range(world_size)) - run.finished))
                    break
                stuck = run.stuck_ranks()
                if stuck:
                    self._after_hang(run, run.watches[run.current[stuck[0]]])
                    break
                time.sleep(_POLL_SECONDS)
        return run.judged

    def _plan(self, tests: list[GradedTest], backend: str) -> protocol.Plan:
        return protocol.Plan(
            tests=[
                protocol.PlannedTest(
                    id=t.id,
                    nodeid=t.nodeid,
                    part=t.part,
                    op_timeout=t.settings.op_timeout,
                    forbid_collectives=t.settings.forbid_collectives,
                    options=t.settings.options,
                )
                for t in tests
            ],
            import_dir=str(self.settings.import_dir),
            backend=backend,
            attempt=self._jobs,
        )

    def _conclude(self, run: _JobRun, watch: _TestWatch, verdict: Verdict) -> None:
        run.judged.add(watch.test.id)
        self.on_verdict(watch.test, verdict)
        if not verdict.passed:
            dependents = {
                w.test.id for w in run.watches.values() if must_pass_first(w.test, watch.test)
            }
            if not dependents <= self.skips:
                self.skips |= dependents
                protocol.write_skips(run.job_dir, self.skips)

    def _after_hang(self, run: _JobRun, watch: _TestWatch) -> None:
        """Judge the test some rank hangs in: who is stuck, where, and waiting for whom."""
        stuck = watch.open_ranks()
        for rank in stuck:
            if rank in run.pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(run.pids[rank], signal.SIGUSR1)  # faulthandler dumps its stacks
        time.sleep(_SETTLE_SECONDS)
        results = dict(watch.results)
        for rank in stuck:
            call, peer = read_waiting(protocol.waiting_path(run.job_dir, rank))
            dump = read_dump(protocol.stacks_path(run.job_dir, rank))
            frames = student_stack(dump, self.settings.import_dir)
            if call:
                text = f"waits in {call}"
            elif frames:
                text = f"is stuck at {frames[0]}"
            else:
                text = "is stuck outside the submission's code"
            results[rank] = RankResult(
                protocol.TIMEOUT,
                f"{text} (stopped after {time.monotonic() - watch.started[rank]:.0f} s)",
                {"waiting_for": peer, "stack": frames},
            )
        importing = sorted(watch.importing & set(stuck))
        if importing:
            reason = f"importing {watch.module} never finished (rank {importing[0]})"
            self.poisoned[watch.test.part] = (protocol.TIMEOUT, reason)
        self._conclude(run, watch, judge(results, run.world_size, watch.seconds()))

    def _after_death(self, run: _JobRun, dead: list[int]) -> None:
        """Judge the test a rank died in; a rank that died between tests blames none."""
        time.sleep(_SETTLE_SECONDS)  # its peers report what they saw of it
        run.read(self.on_start)
        for watch in run.complete():
            self._conclude(run, watch, judge(watch.results, run.world_size, watch.seconds()))
        for test_id in dict.fromkeys(run.current[r] for r in dead if r in run.current):
            if test_id in run.judged:
                continue
            watch = run.watches[test_id]
            results = dict(watch.results)
            for rank in dead:
                if run.current.get(rank) == test_id:
                    during = (
                        "while importing the submission"
                        if rank in watch.importing
                        else "during the test"
                    )
                    results[rank] = RankResult(protocol.CRASHED, f"the process exited {during}")
            if watch.importing & set(dead):
                reason = f"importing {watch.module} ends the process"
                self.poisoned[watch.test.part] = (protocol.CRASHED, reason)
            self._conclude(run, watch, judge(results, run.world_size, watch.seconds()))

    def _skip_poisoned(self, tests: list[GradedTest]) -> list[GradedTest]:
        kept = []
        for test in tests:
            if test.part in self.poisoned:
                outcome, reason = self.poisoned[test.part]
                self.on_verdict(test, Verdict(outcome, f"not run: {reason} (in an earlier test)"))
            else:
                kept.append(test)
        return kept


def _last_words(log: Path, limit: int = 240) -> str:
    """The end of what a dead rank printed: often gloo's reason for aborting it."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines()]
    except OSError:
        return ""
    useful = [line for line in lines if line and not set(line) <= set(".FEsx[]%0123456789 ")]
    text = " ".join(useful[-2:])
    return text if len(text) <= limit else "..." + text[-limit:]


def _launch_failure(job_dir: Path) -> str:
    tail = log_tail(job_dir, 3).replace("\n", " | ")
    return "the grader could not start this job" + (f": {tail}" if tail else "")
