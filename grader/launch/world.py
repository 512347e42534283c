"""A job of sandboxed ranks that the graded tests drive from the trusted side.

    out = world.call("collectives.all_reduce", [(tensor_of(r),) for r in range(world.size)])
    out.args[r][0]     # rank r's tensor after the call

The graded tests run in the grader's own process; the ranks only run the
student's code on arguments made here and send back what came of them. One
torchrun job serves every test of a world size; a job that a rank crashed or
hung in is killed whole and a fresh one starts at the next call.
:meth:`World.call` returns only when every rank returned normally and the
broker saw nothing wrong; otherwise it raises the failure that explains
what happened (:mod:`grader.failures`), blaming the root cause.
"""

from __future__ import annotations

import itertools
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grader import failures, protocol, wire
from grader.broker.ops import Gate, Problem, Returned
from grader.broker.server import Broker
from grader.broker.traffic import Traffic
from grader.failures import Fault
from grader.launch.job import (
    RANK_WRAPPER,
    JobSettings,
    TorchrunJob,
    log_tail,
    node_job,
    prepare_job,
)
from grader.launch.sandboxed import last_words, rank_exit
from grader.protocol import RankError, RankExit
from grader.sandbox import limit_reached
from grader.wire import Frame

if TYPE_CHECKING:
    from grader.launch.nodes import Head

_START_SECONDS = 120.0  # torch's import on a loaded laptop, times every rank


@dataclass
class CallLimits:
    """The current test's rules for its calls (from grading.yaml)."""

    timeout: float = 30.0
    forbid_collectives: bool = False


@dataclass
class CallResult:
    """Every rank's result of one call, and what the broker saw of it."""

    returned: list[Any]
    args: list[tuple[Any, ...]]
    rebound: list[tuple[str, ...]]
    traffic: Traffic
    seconds: float = 0.0


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

    def call(
        self,
        function: str | None = None,
        args: Sequence[Sequence[Any]] = (),
        *,
        scenario: str | None = None,
        case: str = "",
        gates: Sequence[Sequence[Gate]] = (),
    ) -> CallResult:
        """Run ``function`` (``"part.name"`` of the submission) or the grader's ``scenario``
        (``"part.name"`` in :mod:`grader.scenarios`) on every rank, rank r on ``args[r]``;
        rank r's scenario passes ``gates[r]`` (:class:`grader.broker.ops.Gate`) in order."""
        if len(args) != self.size:
            raise ValueError(f"call needs arguments for {self.size} ranks, got {len(args)}")
        key = "function" if function else "scenario"
        try:
            return self._pool.call(
                self.size, key, function or scenario or "", args, self.limits, case, gates
            )
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

    def __init__(self, size: int, settings: JobSettings) -> None:
        self.size = size
        self.settings = settings
        self._job: _Job | None = None
        self._jobs = 0
        # A part whose import ends or hangs the process is not imported again.
        self.poisoned: dict[str, failures.RankFailure] = {}

    def call(
        self,
        world_size: int,
        key: str,
        target: str,
        args: Sequence[Sequence[Any]],
        limits: CallLimits,
        case: str,
        gates: Sequence[Sequence[Gate]] = (),
    ) -> CallResult:
        part = target.split(".")[0]
        if part in self.poisoned:
            raise type(self.poisoned[part])(f"not run: {self.poisoned[part]} (in an earlier test)")
        job = self._running_job()
        call_id = next(job.calls)
        frames = []
        for rank_args in args:
            node, buffers = wire.pack(list(rank_args))
            header = {
                "type": protocol.CALL,
                "call": call_id,
                "world_size": world_size,
                key: target,
                "args": node,
            }
            frames.append(Frame(header, buffers))
        suffix = f" (case: {case})" if case else ""  # every message names the input case
        started = time.monotonic()
        job.broker.start_call(frames, limits.forbid_collectives, [list(g) for g in gates])
        finished = job.broker.wait_call(started + limits.timeout, job.job.running)
        seconds = time.monotonic() - started
        if not finished:
            self._stop_job(job, part, seconds, suffix)
        try:
            return self._judge(job.broker, world_size, suffix, seconds)
        finally:
            if job.broker.broken():
                self.close()

    def _judge(self, broker: Broker, size: int, suffix: str, seconds: float) -> CallResult:
        outcomes = broker.outcomes()
        problems = list(broker.problems)
        forbidden = sorted(p.message for p in problems if p.kind is Fault.FORBIDDEN)
        if forbidden:
            raise failures.ForbiddenCall(forbidden[0])
        own = {
            r: o
            for r, o in enumerate(outcomes)
            if isinstance(o, RankError) and o.type != protocol.REFUSED_ERROR
        }
        if own:
            echoes = [r for r in range(size) if r not in own and _echo(outcomes[r], problems)]
            raise _student_failure(own, echoes, suffix)
        if problems:
            # The most telling kind, then the lowest rank: the same message whatever the timing.
            first = min(problems, key=lambda p: (p.kind.precedence, p.message))
            raise first.kind.failure(first.message + suffix)
        returned = [o for o in outcomes if isinstance(o, Returned)]
        if len(returned) != size:
            raise failures.CommunicationError("a rank's operation was refused" + suffix)
        values = [r.value for r in returned]
        if not all(isinstance(v, dict) and isinstance(v.get("args"), list) for v in values):
            raise failures.CommunicationError("a rank sent back a malformed result" + suffix)
        return CallResult(
            [v.get("returned") for v in values],
            [tuple(v["args"]) for v in values],
            [r.rebound for r in returned],
            broker.traffic,
            seconds,
        )

    # -- jobs -------------------------------------------------------------------------------

    def _running_job(self) -> _Job:
        if self._job is not None and self._job.job.running() and not self._job.broker.dead():
            return self._job
        self.close()
        try:
            self._job = self._start_job()
        except failures.GraderFailure:
            self._job = self._start_job()  # once more, in a fresh job: a busy machine is no fault
        return self._job

    def _start_job(self) -> _Job:
        self._jobs += 1
        job_dir = self.settings.work_dir / f"job{self._jobs}"
        broker = Broker(self.size)
        head = self.settings.head
        if head is None:
            socket_dir = prepare_job(self.settings, job_dir, {})
            broker.listen_unix(socket_dir)
            job = TorchrunJob(job_dir, self.size, RANK_WRAPPER, identity=self.settings.identity)
        else:  # every rank, this node's too, relays to the broker via the head
            job_id = f"grader-job{self._jobs}"
            per_node = head.nodes.per_node(self.size)
            head.start_job(job_id, per_node, broker.serve)
            job, socket_dir = node_job(
                self.settings, job_dir, head.nodes, job_id, per_node, head.address, head.key
            )
        job.start()
        deadline = time.monotonic() + _START_SECONDS
        while len(broker.connected()) < self.size:
            failure = head.problem() if head is not None else None
            if failure is None and (
                not job.running() or broker.dead() or time.monotonic() > deadline
            ):
                reason = _first_words(job_dir, broker, self.size) or log_tail(job_dir, 3)
                failure = f"the grader could not start a job of {self.size} ranks: {reason}"
            if failure is not None:
                job.kill()
                broker.close()
                shutil.rmtree(socket_dir, ignore_errors=True)
                raise failures.GraderFailure(failure)
            time.sleep(0.02)
        return _Job(job, broker, job_dir, socket_dir)

    def _stop_job(self, job: _Job, part: str, seconds: float, suffix: str) -> None:
        """A rank died or is stuck: say which and where, then end the job whole."""
        broker = job.broker
        importing = broker.importing()
        dead = broker.dead()
        if dead or not job.job.running():
            time.sleep(0.2)  # let the exit statuses land
            head = self.settings.head
            exits = {r: _ended(head, broker, job.job_dir, r) for r in dead or range(self.size)}
            self._check_nodes(exits)
            culprit = _first_dead(exits)
            during = "while importing the submission" if culprit in importing else "during the call"
            ended = exits[culprit]
            failure: failures.RankFailure = failures.Crashed(
                f"rank {culprit}: the process died {during} "
                f"({ended.describe() if ended else 'no exit status'})"
                + suffix
                + (f"; its last output: {ended.last_words}" if ended and ended.last_words else "")
            )
        else:
            stuck = broker.still_running()
            blocked = broker.blocked()
            stacks = broker.stacks([r for r in stuck if r not in blocked])
            parts = []
            for rank in stuck:
                if rank in blocked:
                    parts.append(f"rank {rank} waits in {blocked[rank]}")
                elif stacks.get(rank):
                    parts.append(f"rank {rank} is stuck at {stacks[rank][-1]}")
                else:
                    parts.append(f"rank {rank} is stuck outside the submission's code")
            failure = failures.TimedOut(
                ("; ".join(parts) if parts else "a rank never returned")
                + f" (stopped after {seconds:.0f} s)"
                + suffix
            )
            culprit = stuck[0] if stuck else -1
        self.close()
        if culprit in importing:
            ends = (
                "never finishes" if isinstance(failure, failures.TimedOut) else "ends the process"
            )
            self.poisoned[part] = type(failure)(f"importing {importing[culprit]} {ends}")
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
        if self._job is not None:
            self._job.job.kill()
            self._job.broker.close()
            shutil.rmtree(self._job.socket_dir, ignore_errors=True)
            self._job = None


def _echo(outcome: Returned | RankError | None, problems: list[Problem]) -> bool:
    """A rank that only suffered from another's failure: its operation was refused."""
    return (isinstance(outcome, RankError) and outcome.type == protocol.REFUSED_ERROR) or (
        any(p.kind is Fault.DEADLOCK for p in problems) and outcome is not None
    )


def _student_failure(
    own: dict[int, RankError], echoes: list[int], suffix: str
) -> failures.RankFailure:
    first_rank, first = min(own.items())
    same = [r for r, e in own.items() if (e.type, e.message) == (first.type, first.message)]
    who = f"rank {first_rank}" if len(same) == 1 else f"ranks {_ranks(same)}"
    if first.type == "NotImplementedError":
        name = first.raiser or "the function"
        return failures.NotImplementedYet(f"not implemented yet: {name} raises NotImplementedError")
    text = f"{who}: {first.type}: {first.message}".rstrip(": ") + first.where() + suffix
    if limit := limit_reached(f"{first.type}: {first.message}"):
        text += f"; the rank reached its sandbox's limit on {limit}"
    others = [r for r in own if r not in same]
    if others:
        text += f"; rank {others[0]} also raised {own[others[0]].type}"
    if echoes:
        text += f"; then {'rank' if len(echoes) == 1 else 'ranks'} {_ranks(echoes)} waited in vain"
    return failures.StudentError(text)


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


def _first_dead(exits: dict[int, RankExit | None]) -> int:
    """The rank that died on its own: not one stopped after it (SIGKILL, SIGTERM)."""
    for rank, ended in exits.items():
        if ended is not None and not ended.stopped_by_grader:
            return rank
    return next(iter(exits))


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
