"""A job of sandboxed ranks that the graded tests drive from the trusted side.

    out = world.call("collectives.all_reduce", [(tensor_of(r),) for r in range(world.size)])
    out.args[r][0]     # rank r's tensor after the call

The graded tests run in the grader's own process; the ranks only run the
student's code on arguments made here and send back what came of them. One
torchrun job serves every test of a world size; a job that a rank crashed or
hung in is killed whole and a fresh one starts at the next call.
The pool runs a call and reports what came of it as data; the judge of a
call (:mod:`grader.judge.call`) turns that into the result, or into the
failure that explains what happened, blaming the root cause.
"""

from __future__ import annotations

import itertools
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grader import failures, protocol
from grader.broker.ops import Gate
from grader.broker.server import Broker
from grader.judge.call import (
    CallResult,
    Died,
    Finished,
    Stopped,
    Stuck,
    judge_finished,
    judge_stopped,
    poisoned_import,
)
from grader.launch.job import (
    JobSettings,
    Launched,
    TorchrunJob,
    job_folder,
    launch,
    log_tail,
    node_job,
)
from grader.launch.sandboxed import last_words, rank_exit
from grader.protocol import RankExit

if TYPE_CHECKING:
    from grader.nodes.head import Head

_START_SECONDS = 120.0  # torch's import on a loaded laptop, times every rank
_END_SECONDS = 5.0  # a rank died: torchrun's agent ends the others and exits (0.1 s checks)


@dataclass
class CallLimits:
    """The current test's rules for its calls (from grading.yaml)."""

    timeout: float = 30.0
    forbid_collectives: bool = False


@dataclass
class _Job:
    job: TorchrunJob
    broker: Broker
    job_dir: Path
    socket_dir: Path
    calls: itertools.count = field(default_factory=lambda: itertools.count(1))


class World:
    """The first ``size`` ranks of the pool's job, as one world: what a graded test drives."""

    def __init__(self, size: int, pool: RankPool, limits: CallLimits) -> None:
        self.size = size
        self.limits = limits
        self._pool = pool
        # A world serves one test: its first call starts the submission afresh on every rank.
        self._fresh = True

    def call(
        self,
        function: str | None = None,
        args: Sequence[Sequence[Any]] = (),
        *,
        scenario: str | None = None,
        case: str = "",
        gates: Sequence[Sequence[Gate]] = (),
        keep_payloads: bool = True,
        timed: bool = False,
    ) -> CallResult:
        """Run ``function`` (``"part.name"`` of the submission) or the grader's ``scenario``
        (``"part.name"`` in :mod:`grader.scenarios`) on every rank, rank r on ``args[r]``;
        rank r's scenario passes ``gates[r]`` (:class:`grader.broker.ops.Gate`) in order.
        ``keep_payloads=False``: the result's traffic records every message and collective,
        but not what they carried (``Event.payload`` is empty): for calls that move megabytes
        and whose tests read only sizes, times and results. ``timed``: the broker measures each
        rank's local work (``out.traffic.local_work()``), for the performance tests."""
        if len(args) != self.size:
            raise ValueError(f"call needs arguments for {self.size} ranks, got {len(args)}")
        if gates and not keep_payloads:
            raise ValueError("gates open on what all-reduces carried: keep the payloads")
        request = protocol.CallRequest(
            self.size,
            function or scenario or "",
            args,
            scenario=not function,
            case=case,
            gates=gates,
            keep_payloads=keep_payloads,
            fresh=self._fresh,
            timed=timed,
        )
        self._fresh = False
        try:
            return self._pool.call(request, self.limits)
        except (failures.RankFailure, failures.GraderFailure):
            raise
        except Exception as err:  # the grader's own machinery: never the student's doing
            raise failures.GraderFailure(
                f"the grader failed running {function or scenario}: {type(err).__name__}: {err}"
            ) from err


class RankPool:
    """One torchrun job of ``size`` sandboxed ranks, serving every smaller world size too.

    A job costs seconds to start (torch's import on every rank), so one job
    serves the whole grading run: a call at world size n runs on ranks
    0..n-1, which form a process group of n ranks for it. A job that a rank
    crashed or hung in is killed whole, and the next call starts a fresh one.
    """

    def __init__(self, size: int, settings: JobSettings, launched: Launched | None = None) -> None:
        """``launched``: its job, started already (:func:`grader.launch.job.launch`)."""
        self.size = size
        self.settings = settings
        self._job: _Job | None = None
        # started ahead, its ranks not yet all connected
        self._starting: _Job | None = _served(launched) if launched is not None else None
        self._when_started: list[Callable[[], None]] = []
        # A part whose import ends or hangs the process is not imported again.
        self.poisoned: dict[str, failures.RankFailure] = {}

    def call(self, request: protocol.CallRequest, limits: CallLimits) -> CallResult:
        """Run ``request`` on its first ranks, bound by ``limits``."""
        part, case = request.part, request.case
        if part in self.poisoned:
            raise type(self.poisoned[part])(f"not run: {self.poisoned[part]} (in an earlier test)")
        job = self._running_job()
        frames = request.frames(next(job.calls))
        started = time.monotonic()
        job.broker.start_call(
            frames,
            limits.forbid_collectives,
            [list(g) for g in request.gates],
            request.keep_payloads,
            request.timed,
        )
        finished = job.broker.wait_call(started + limits.timeout)
        seconds = time.monotonic() - started
        if not finished:
            self._stop_job(job, part, seconds, case)
        broker = job.broker
        outcomes, problems = broker.outcomes(), list(broker.problems)
        report = Finished(request.world_size, outcomes, problems, broker.traffic, seconds)
        try:
            return judge_finished(report, case)
        finally:
            if broker.broken():
                self.close()

    # -- jobs -------------------------------------------------------------------------------

    def start_ahead(self) -> None:
        """Start the job now, without waiting for its ranks: the first call will find them
        with torch imported (watch mode starts the next grading's job while the student edits).
        A job that cannot start is retried and reported at that first call."""
        if self._job is None and self._starting is None:
            self._starting = self._launch_job()

    def when_started(self, then: Callable[[], None]) -> None:
        """Run ``then`` once this pool's job has every rank connected: another job started
        then leaves this one's ranks the CPUs while they import torch, which the first call
        waits for."""
        self._when_started.append(then)

    def _running_job(self) -> _Job:
        if self._job is not None and self._job.job.running() and not self._job.broker.dead():
            return self._job
        starting, self._starting = self._starting, None
        self.close()
        # Kept as starting until its ranks are connected: an interrupt meanwhile (Ctrl-C,
        # SIGTERM) leaves it where close() ends it.
        self._starting = starting or self._launch_job()
        try:
            self._job = self._connected(self._starting)
        except failures.GraderFailure:
            # once more, in a fresh job: a busy machine is no fault
            self._starting = self._launch_job()
            self._job = self._connected(self._starting)
        self._starting = None
        waiting, self._when_started = self._when_started, []
        for then in waiting:  # not on an interrupt or a failure: the run is ending then
            then()
        return self._job

    def _launch_job(self) -> _Job:
        head = self.settings.head
        if head is None:
            return _served(launch(self.settings, self.size))
        # every rank, this node's too, relays to the broker via the head
        job_dir = job_folder(self.settings)
        broker = Broker(self.size)
        socket_dir, job = None, None
        try:
            job_id = f"grader-{job_dir.name}"
            per_node = head.nodes.per_node(self.size)
            head.start_job(job_id, per_node, broker.serve)
            job, socket_dir = node_job(
                self.settings, job_dir, head.nodes, job_id, per_node, head.address, head.key
            )
            job.start()
        except BaseException:  # an interrupt before the pool holds the job: end what began
            if job is not None:
                job.kill()
            broker.close()
            if socket_dir is not None:
                shutil.rmtree(socket_dir, ignore_errors=True)
            raise
        threading.Thread(target=_watch, args=(job, broker), daemon=True).start()
        head.watch(broker.end_job)
        return _Job(job, broker, job_dir, socket_dir)

    def _connected(self, started: _Job) -> _Job:
        """``started`` once every rank said hello; a job that did not is ended and reported."""
        broker, job_dir, head = started.broker, started.job_dir, self.settings.head
        if not broker.wait_connected(time.monotonic() + _START_SECONDS):
            failure = head.problem() if head is not None else None
            if failure is None:
                reason = _first_words(job_dir, broker, self.size) or log_tail(job_dir, 3)
                failure = f"the grader could not start a job of {self.size} ranks: {reason}"
            _end(started)
            raise failures.GraderFailure(failure)
        return started

    def _stop_job(self, job: _Job, part: str, seconds: float, case: str) -> None:
        """A rank died or is stuck: report which and where to the judge, end the job whole."""
        broker = job.broker
        importing = broker.importing()
        dead = broker.dead()
        report: Stopped
        if dead or broker.ended is not None:
            broker.wait_ended(dead or list(range(self.size)), time.monotonic() + _END_SECONDS)
            head = self.settings.head
            exits = {r: _ended(head, broker, job.job_dir, r) for r in dead or range(self.size)}
            self._check_nodes(exits)
            report = Died(exits, importing)
        else:
            running = broker.still_running()
            blocked = broker.blocked()
            stacks = broker.stacks([r for r in running if r not in blocked])
            unread = broker.unread(running)
            report = Stuck(running, blocked, stacks, importing, seconds, unread)
        failure, culprit = judge_stopped(report, case)
        self.close()
        if culprit in importing:
            self.poisoned[part] = poisoned_import(failure, importing[culprit])
        raise failure

    def _check_nodes(self, exits: dict[int, RankExit | None]) -> None:
        """Across nodes, a rank whose relay said nothing, or a node gone, is the grader's
        failure, not the student's: the machinery between nodes broke."""
        head = self.settings.head
        if head is None:
            return
        if (gone := head.problem()) is not None:
            self.close()
            raise failures.GraderFailure(gone)
        silent = [r for r, e in exits.items() if e is None]
        if silent and len(silent) == len(exits):
            self.close()
            raise failures.GraderFailure(
                f"lost the connection to rank {silent[0]} on another node, with no word of how "
                "it ended"
            )

    def close(self) -> None:
        for job in (self._job, self._starting):
            if job is not None:
                _end(job)
        self._job = self._starting = None


def _served(launched: Launched) -> _Job:
    """A job of this machine's ranks, ``launched`` already, with its broker now up."""
    broker = None
    try:
        broker = Broker(launched.job.per_node)
        broker.accept_on(launched.listeners)
        threading.Thread(target=_watch, args=(launched.job, broker), daemon=True).start()
        return _Job(launched.job, broker, launched.job_dir, launched.socket_dir)
    except BaseException:  # an interrupt before the pool holds the job: end it
        if broker is not None:
            broker.close()
        launched.end()
        raise


def _end(job: _Job) -> None:
    job.job.kill()
    job.broker.close()
    shutil.rmtree(job.socket_dir, ignore_errors=True)


def _watch(job: TorchrunJob, broker: Broker) -> None:
    """The job's torchrun exiting is an event of the broker's, as a rank's end is."""
    code = job.wait()
    broker.end_job(f"torchrun exited with status {code}")


def _first_words(job_dir: Path, broker: Broker, size: int) -> str:
    for rank in range(size):
        ended = broker.exits.get(rank)
        words = ended.last_words if ended else last_words(job_dir, rank)
        if words:
            return words
    return ""


def _ended(head: Head | None, broker: Broker, job_dir: Path, rank: int) -> RankExit | None:
    """How a rank ended: across nodes, as its relay told the broker (no other machine's files
    are read); on one machine, as its wrapper left it in the job's folder."""
    if head is not None:
        return broker.exits.get(rank)
    return rank_exit(job_dir, rank)
