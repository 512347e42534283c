"""The one judge of a call: what the broker saw and how the ranks ended, turned into the
call's result or into the failure that explains it, blaming the root cause.

The launcher (:mod:`grader.launch.world`) runs the call and reports, as data, one of two
things: the call ended (:class:`Finished`: every rank's outcome and the problems the
broker saw), or the job had to be stopped (:class:`Stopped`: the ranks that died and how,
or those still running and where they wait). Nothing here runs or stops a job.

The order of blame, the same whatever the timing:

1. a built-in collective where the part forbids them;
2. a rank's own exception (the lowest rank; those that only waited for it are echoes);
3. the broker's most telling problem (:class:`grader.failures.Fault` owns the order);
4. a rank that died (the first that died on its own, not one stopped after it), or the
   ranks that never returned, each with where it waits.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grader import failures, protocol
from grader.broker.ops import Problem, Returned
from grader.broker.traffic import Traffic
from grader.failures import Fault
from grader.protocol import RankError, RankExit
from grader.sandbox import limit_reached


@dataclass
class CallResult:
    """Every rank's result of one call, and what the broker saw of it."""

    returned: list[Any]
    args: list[tuple[Any, ...]]
    rebound: list[tuple[str, ...]]
    traffic: Traffic
    seconds: float = 0.0


@dataclass(frozen=True)
class Finished:
    """A call every rank ended: how each did, and what the broker saw."""

    size: int
    outcomes: Sequence[Returned | RankError | None]
    problems: Sequence[Problem]
    traffic: Traffic
    seconds: float


@dataclass(frozen=True)
class Died:
    """The job stopped because ranks died: how each rank of ``exits`` ended (None: no word)."""

    exits: Mapping[int, RankExit | None]
    importing: Mapping[int, str]  # rank -> the module it was importing when it stopped


@dataclass(frozen=True)
class Stuck:
    """The job stopped because ranks never returned within the test's time."""

    running: Sequence[int]  # the ranks still in the call, lowest first
    blocked: Mapping[int, str]  # rank -> the operation it waits in, for those that wait
    stacks: Mapping[int, Sequence[str]]  # rank -> its stack, for the others
    importing: Mapping[int, str]
    seconds: float
    # The ranks the broker could not write to: what it sent them waited, unread, even after
    # it asked for their stacks.
    unread: Collection[int] = ()


Stopped = Died | Stuck


def case_suffix(case: str) -> str:
    """What every message of a call ends with: the input case it ran on."""
    return f" (case: {case})" if case else ""


def judge_finished(report: Finished, case: str) -> CallResult:
    """The call's result, or the failure that explains why there is none."""
    suffix = case_suffix(case)
    outcomes, problems = report.outcomes, list(report.problems)
    forbidden = sorted(p.message for p in problems if p.kind is Fault.FORBIDDEN)
    if forbidden:
        raise failures.ForbiddenCall(forbidden[0])
    own = {
        r: o
        for r, o in enumerate(outcomes)
        if isinstance(o, RankError) and o.type != protocol.REFUSED_ERROR
    }
    if own:
        echoes = [r for r in range(report.size) if r not in own and _echo(outcomes[r], problems)]
        raise _student_failure(own, echoes, case)
    if problems:
        # The most telling kind, then the lowest rank: the same message whatever the timing.
        first = min(problems, key=lambda p: (p.kind.precedence, p.message))
        raise first.kind.failure(first.message + suffix, case, first.kind.cause)
    returned = [o for o in outcomes if isinstance(o, Returned)]
    if len(returned) != report.size:
        raise failures.CommunicationError("a rank's operation was refused" + suffix, case)
    return CallResult(
        [r.returned for r in returned],
        [r.args for r in returned],
        [r.rebound for r in returned],
        report.traffic,
        report.seconds,
    )


def judge_stopped(report: Stopped, case: str) -> tuple[failures.RankFailure, int]:
    """The failure of a call whose job had to be stopped, and the rank it blames (-1: none)."""
    suffix = case_suffix(case)
    if isinstance(report, Died):
        culprit = first_dead(report.exits)
        during = (
            "while importing the submission" if culprit in report.importing else "during the call"
        )
        ended = report.exits[culprit]
        return failures.Crashed(
            f"rank {culprit}: the process died {during} "
            f"({ended.describe() if ended else 'no exit status'})"
            + suffix
            + (f"; its last output: {ended.last_words}" if ended and ended.last_words else ""),
            case,
        ), culprit
    parts = []
    for rank in report.running:
        if rank in report.unread:
            parts.append(f"rank {rank} stopped reading what the grader sends it")
        elif rank in report.blocked:
            parts.append(f"rank {rank} waits in {report.blocked[rank]}")
        elif report.stacks.get(rank):
            parts.append(f"rank {rank} is stuck at {report.stacks[rank][-1]}")
        else:
            parts.append(f"rank {rank} is stuck outside the submission's code")
    failure = failures.TimedOut(
        ("; ".join(parts) if parts else "a rank never returned")
        + f" (stopped after {report.seconds:.0f} s)"
        + suffix,
        case,
    )
    return failure, report.running[0] if report.running else -1


def poisoned_import(failure: failures.RankFailure, module: str) -> failures.RankFailure:
    """What every later call of a part gets when importing ``module`` ended the process or
    never finished: the part is not imported again."""
    ends = "never finishes" if isinstance(failure, failures.TimedOut) else "ends the process"
    return type(failure)(f"importing {module} {ends}")


def first_dead(exits: Mapping[int, RankExit | None]) -> int:
    """The rank that died on its own: not one stopped after it (SIGKILL, SIGTERM)."""
    for rank, ended in exits.items():
        if ended is not None and not ended.stopped_by_grader:
            return rank
    return next(iter(exits))


def _echo(outcome: Returned | RankError | None, problems: list[Problem]) -> bool:
    """A rank that only suffered from another's failure: its operation was refused."""
    return (isinstance(outcome, RankError) and outcome.type == protocol.REFUSED_ERROR) or (
        any(p.kind is Fault.DEADLOCK for p in problems) and outcome is not None
    )


def _student_failure(
    own: dict[int, RankError], echoes: list[int], case: str
) -> failures.RankFailure:
    first_rank, first = min(own.items())
    same = [r for r, e in own.items() if (e.type, e.message) == (first.type, first.message)]
    who = f"rank {first_rank}" if len(same) == 1 else f"ranks {_ranks(same)}"
    if first.type == "NotImplementedError":
        name = first.raiser or "the function"
        return failures.NotImplementedYet(f"not implemented yet: {name} raises NotImplementedError")
    text = f"{who}: {first.type}: {first.message}".rstrip(": ") + first.where() + case_suffix(case)
    if first.refused:  # an attempt the TA should see: its own outcome, the line named
        return failures.ForbiddenCall(text, case, failures.Cause.REFUSED, first.where())
    if limit := limit_reached(f"{first.type}: {first.message}"):
        text += f"; the rank reached its sandbox's limit on {limit}"
    others = [r for r in own if r not in same]
    if others:
        text += f"; rank {others[0]} also raised {own[others[0]].type}"
    if echoes:
        text += f"; then {'rank' if len(echoes) == 1 else 'ranks'} {_ranks(echoes)} waited in vain"
    return failures.StudentError(text, case, check=f"{first.type}{first.where()}")


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))
