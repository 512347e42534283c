"""Judging what a collective costs: bytes, rounds, and time, messages and local work.

``communication``: the bytes the busiest rank moves against the classic lower
bound (``grader/judge/communication.py``), and the rounds: a deterministic
function of the message pattern, the same on a quiet laptop and a loaded server.

``performance``: the larger of two ratios to the reference. The messages:
the pattern replayed on the machine models of ``machines.yaml`` (alpha-beta
links, one port per rank, each receive waiting for its send), against the
reference's pattern of the same call (:func:`reference_messages`, kept as
data: :mod:`grader.judge.reference_traces` rebuilds it), the geometric mean
over the machines. The local work: each rank's CPU time and time spent
neither computing nor in a message, from the kernel (never from the rank),
laid on its messages and replayed on free links, against the reference's
timed beside it on this machine (:func:`time_calls`), charging only what
exceeds the reference's by more than an allowance (:func:`local_ratio`): the
noise of timing on a busy machine. Full points within
``full_at`` times the reference, none beyond ``zero_at``, linear between.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from grader.broker.traffic import Message, RankWork, Traffic
from grader.judge import communication
from grader.judge.call import CallResult
from grader.judge.projection import LOCAL_WORK, machines, project
from grader.judge.reference_traces import reference_messages
from grader.judge.replay import ReplayError
from grader.launch.world import World
from grader.report.units import duration, size
from grader.testkit.calls import Expected, collective_call

__all__ = [
    "WARM_UP",
    "Judgement",
    "Timed",
    "Timing",
    "judge_communication",
    "judge_performance",
    "local_ratio",
    "reference_messages",
    "time_calls",
]

Messages = list[list[Message]]  # every rank's point-to-point events, in program order
#: The inputs' key of a warm-up call, made before the timed ones: what a first call costs
#: once (an import, a first allocation) is not charged to them.
WARM_UP = "costs/warm-up"
WARM_UPS = 1  # a first call costs more: an import, the allocator's first pages
RUNS = 5  # calls of each side in a round
ROUNDS = 4  # at most, while the submission's local work looks too slow
NO_REFERENCE = "no reference to time it against here (a student's release, or across nodes)"
UNMEASURED = "not measured here (a rank on another node, or no /proc schedstat)"


@dataclass(frozen=True)
class Judgement:
    fraction: float
    message: str
    details: dict[str, Any] = field(default_factory=dict)


def replayable(judge: Callable[..., Judgement]) -> Callable[..., Judgement]:
    """A message pattern that cannot be replayed to its end earns nothing, and says why."""

    @functools.wraps(judge)
    def judged(*args: Any, **kwargs: Any) -> Judgement:
        try:
            return judge(*args, **kwargs)
        except ReplayError as err:
            return Judgement(0.0, str(err))

    return judged


@replayable
def judge_communication(
    function: str, p: int, n_bytes: int, mine: Messages, theirs: Messages, allowed: float
) -> Judgement:
    student = communication.figures(mine)
    reference = communication.figures(theirs)
    bound = communication.bound_bytes(function, p, n_bytes)
    ratio = student.busiest_bytes / bound if bound else 1.0
    projections = {
        m.name: {"student_seconds": project(mine, m), "reference_seconds": project(theirs, m)}
        for m in machines()
    }
    details = {
        "student": student.as_dict(),
        "reference": reference.as_dict(),
        "bound_bytes": bound,
        "bytes_ratio": round(ratio, 4),
        "min_rounds": communication.min_rounds(p),
        "projected": projections,
    }
    rows = [
        f"{function} of {size(n_bytes)} on {p} ranks      yours      reference  bound",
        f"  busiest rank moves            {size(student.busiest_bytes):>9}"
        f"  {size(reference.busiest_bytes):>9}  {size(bound):>9}",
        f"  ratio to the bound            {ratio:>9.2f}"
        f"  {reference.busiest_bytes / bound if bound else 1:>9.2f}       1.00",
        f"  messages                      {student.messages:>9}  {reference.messages:>9}",
        f"  rounds                        {student.rounds:>9}  {reference.rounds:>9}"
        f"  >= {communication.min_rounds(p)}",
    ]
    for name, times in projections.items():
        rows.append(
            f"  projected on {name:<17}{duration(times['student_seconds']):>9}"
            f"  {duration(times['reference_seconds']):>9}"
        )
    table = "\n".join(rows)
    if ratio <= allowed + 1e-9:
        return Judgement(1.0, table, details)
    advice = (
        f"the busiest rank (rank {student.busiest_rank}) moves {ratio:.2f}x the bound; "
        f"at most {allowed:g}x earns the points"
    )
    return Judgement(0.0, f"{advice}\n{table}", details)


@dataclass(frozen=True)
class Timed:
    """One call's message logs with every rank's local work laid on them (from the broker's
    accounting: :meth:`grader.broker.traffic.Traffic.local_work`)."""

    messages: Messages
    work: list[RankWork]

    @classmethod
    def of(cls, traffic: Traffic) -> Timed | None:
        """The call's timed logs; None where a rank's local time was not measured."""
        work = traffic.local_work()
        return cls(traffic.messages(), work) if work is not None else None

    @functools.cached_property
    def critical_path(self) -> float:
        """Seconds of local work on the call's critical path: the replay on free links (made
        once: the timing loop compares it call after call)."""
        return project(self.messages, LOCAL_WORK, self.work)


@dataclass(frozen=True)
class Timing:
    """The submission's call that :func:`time_calls` judges, and both sides' local work: None
    where the submission's was not timed, why not where the reference's was not."""

    out: CallResult
    yours: Timed | None
    reference: Timed | str


def time_calls(
    function: str,
    n: int,
    world: World,
    reference: World | None,
    check: Callable[[CallResult, list[Expected]], None],
    within: float,
    allowance: float,
) -> Timing:
    """Time the submission's call of ``function`` on ``n`` elements against the reference's,
    run in its own job on this machine: :data:`WARM_UPS` calls each, then rounds of
    :data:`RUNS` each, in turn, so that both meet the machine in the same state, on the same
    inputs, which differ from call to call (none can reuse another's work). ``check`` checks
    each of the submission's results. The least local work of each side is its time (the
    machine's noise only ever adds to it), with the submission's call that took it. While
    its :func:`local_ratio` (with ``allowance``) is beyond ``within``, another round, up to
    :data:`ROUNDS`: a busy moment of the machine's never costs points, a slow submission
    stays slow."""
    target, case = f"collectives.{function}", f"{function} of {n} float32 elements"

    def both(key: str) -> tuple[CallResult, Timed | None, Timed | None]:
        args, expected = collective_call(function, world.size, n, key)
        # Only sizes, times and results are judged here: 4 MB payloads are not kept.
        out = world.call(target, args, case=case, keep_payloads=False, timed=True)
        check(out, expected)
        if reference is None:
            return out, Timed.of(out.traffic), None
        theirs = reference.call(
            target, args, case=f"the reference's {case}", keep_payloads=False, timed=True
        )
        return out, Timed.of(out.traffic), Timed.of(theirs.traffic)

    for i in range(WARM_UPS):
        both(f"{WARM_UP}/{i}")
    best: tuple[Timed, CallResult] | None = None
    best_theirs: Timed | None = None
    for call in range(ROUNDS * RUNS):
        out, mine, theirs = both(f"costs/timed/{call}")
        if mine is None:
            return Timing(out, None, UNMEASURED)
        if best is None or mine.critical_path < best[0].critical_path:
            best = (mine, out)
        if reference is not None and theirs is None:
            return Timing(best[1], best[0], UNMEASURED)
        if theirs and (not best_theirs or theirs.critical_path < best_theirs.critical_path):
            best_theirs = theirs
        if (call + 1) % RUNS == 0 and (
            best_theirs is None or local_ratio(best[0], best_theirs, allowance) <= within
        ):
            break
    assert best is not None
    return Timing(best[1], best[0], best_theirs or NO_REFERENCE)


def local_ratio(yours: Timed, reference: Timed, allowance: float) -> float:
    """The submission's local work over the reference's, on their critical paths, charging
    only what exceeds the reference's by more than ``allowance`` seconds: below that, a
    difference is the noise of timing a call on a busy machine, not the submission's doing."""
    mine, theirs = yours.critical_path, reference.critical_path
    if theirs <= 0:
        return 1.0
    return 1.0 + max(0.0, mine - theirs - allowance) / theirs


@replayable
def judge_performance(
    function: str,
    p: int,
    n_bytes: int,
    mine: Messages,
    theirs: Messages,
    full_at: float,
    zero_at: float,
    yours: Timed | None = None,
    reference: Timed | str = "",
    allowance: float = 0.0,
) -> Judgement:
    """The busier of two ratios to the reference: the messages' time on the machine models,
    and, where both calls were timed on this machine (``yours``, ``reference``), the local
    work's critical path. ``reference`` is why not, where the reference was not timed."""
    factor = communication.BUS_FACTOR[function](p)
    rows, ratios, details = [], [], {}
    for machine in machines():
        student_s, reference_s = project(mine, machine), project(theirs, machine)
        ratios.append(student_s / reference_s if reference_s > 0 else 1.0)
        details[machine.name] = {
            "student_seconds": student_s,
            "reference_seconds": reference_s,
            "student_algbw_GBps": n_bytes / student_s / 1e9 if student_s else None,
            "student_busbw_GBps": n_bytes / student_s / 1e9 * factor if student_s else None,
            "reference_busbw_GBps": n_bytes / reference_s / 1e9 * factor if reference_s else None,
        }
        busbw = details[machine.name]["student_busbw_GBps"] or 0.0
        rows.append(
            f"    {machine.name:<18} yours {duration(student_s):>9} (busbw {busbw:8.2f} GB/s), "
            f"reference {duration(reference_s):>9}: {ratios[-1]:.2f}x"
        )
    messages = math.exp(sum(math.log(max(r, 1e-12)) for r in ratios) / len(ratios))
    local, local_rows = _judge_local(yours, reference, allowance, details)
    ratio = max(messages, local or 0.0)
    fraction = 1.0 if ratio <= full_at else max(0.0, (zero_at - ratio) / (zero_at - full_at))
    details["messages_ratio"] = round(messages, 4)
    details["time_ratio"] = round(ratio, 4)
    header = (
        f"{function} of {size(n_bytes)} on {p} ranks: {ratio:.2f}x the reference's time "
        f"(full points within {full_at:g}x, none beyond {zero_at:g}x)"
    )
    lines = [f"  your messages replayed on real machines: {messages:.2f}x (geometric mean)", *rows]
    lines = [*local_rows, *lines] if local is not None and local > messages else lines + local_rows
    return Judgement(fraction, "\n".join([header, *lines]), details)


def _judge_local(
    yours: Timed | None, reference: Timed | str, allowance: float, details: dict[str, Any]
) -> tuple[float | None, list[str]]:
    """The local work's ratio to the reference's (None: not timed), and the lines that say it
    and where the time went."""
    if yours is not None:
        details["local_time"] = [_local_figures(w) for w in yours.work]
    if yours is None or isinstance(reference, str):
        why = UNMEASURED if yours is None or not reference else reference
        details["local_ratio"] = None
        return None, [f"  local work not judged: {why}"]
    mine, theirs = yours.critical_path, reference.critical_path
    ratio = local_ratio(yours, reference, allowance)
    details["local_ratio"] = round(ratio, 4)
    details["local_allowance_seconds"] = allowance
    details["local_critical_path_seconds"] = {"student": mine, "reference": theirs}
    busiest = max(range(len(yours.work)), key=lambda r: yours.work[r].cpu + yours.work[r].outside)
    work = yours.work[busiest]
    return ratio, [
        f"  your local work, timed on this machine: {duration(mine)} on the call's critical "
        f"path, the reference's {duration(theirs)}: {ratio:.2f}x (what is over the "
        f"reference's by more than {duration(allowance)} counts)",
        f"    rank {busiest} spent {duration(work.cpu)} computing{_longest(work.longest_cpu)} "
        f"and {duration(work.outside)} neither computing nor in a message (a sleep or a wait "
        f"outside torch.distributed){_longest(work.longest_outside, work.outside)}",
    ]


def _longest(stretch: tuple[float, str], total: float | None = None) -> str:
    """The longest stretch of a kind of local time, where it is worth naming."""
    seconds, where = stretch
    if seconds < 1e-3 or (total is not None and seconds < 0.1 * total):
        return ""
    return f" ({duration(seconds)} of it {where})"


def _local_figures(work: RankWork) -> dict[str, Any]:
    return {
        "cpu_seconds": round(work.cpu, 6),
        "outside_seconds": round(work.outside, 6),
        "waiting_seconds": round(work.waiting, 6),
        "longest_cpu_seconds": round(work.longest_cpu[0], 6),
        "longest_cpu_before": work.longest_cpu[1],
        "longest_outside_seconds": round(work.longest_outside[0], 6),
        "longest_outside_before": work.longest_outside[1],
    }
