"""Judging what a collective costs, from the messages the broker carried: bytes, rounds, time.

Both judgements are deterministic functions of the message pattern: the same
code earns the same points on a quiet laptop and on a loaded grading server.

``communication``: the bytes the busiest rank moves against the classic lower
bound (``grader/judge/communication.py``), and the rounds.

``performance``: the pattern replayed on the machine models of
``machines.yaml`` (alpha-beta links, one port per rank, each receive waiting
for its send), against the reference's pattern of the same call. The ratio is
the geometric mean over the machines; full points within ``full_at`` times the
reference's time, none beyond ``zero_at``, linear between. It models the
messages only: local arithmetic, which the broker cannot see, is not timed.

The reference's pattern of a call comes from :func:`reference_messages`, kept as data
(:mod:`grader.judge.reference_traces` rebuilds it).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from grader.broker.accounting import LocalTime
from grader.judge import communication
from grader.judge.projection import machines, project
from grader.judge.reference_traces import reference_messages
from grader.judge.replay import ReplayError
from grader.report.units import duration, size

__all__ = ["Judgement", "judge_communication", "judge_performance", "reference_messages"]

Messages = list[list[dict[str, Any]]]  # every rank's point-to-point events, in program order


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


@replayable
def judge_performance(
    function: str,
    p: int,
    n_bytes: int,
    mine: Messages,
    theirs: Messages,
    full_at: float,
    zero_at: float,
    local: Sequence[LocalTime] = (),
) -> Judgement:
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
            f"  {machine.name:<20} yours {duration(student_s):>9} (busbw {busbw:8.2f} GB/s), "
            f"reference {duration(reference_s):>9}: {ratios[-1]:.2f}x"
        )
    ratio = math.exp(sum(math.log(max(r, 1e-12)) for r in ratios) / len(ratios))
    fraction = 1.0 if ratio <= full_at else max(0.0, (zero_at - ratio) / (zero_at - full_at))
    details["time_ratio"] = round(ratio, 4)
    details["local_time"] = [_local_figures(t) for t in local]
    header = (
        f"{function} of {size(n_bytes)} on {p} ranks, your messages replayed on real machines: "
        f"{ratio:.2f}x the reference's time (geometric mean; full points within {full_at:g}x, "
        f"none beyond {zero_at:g}x; local arithmetic is not modelled)"
    )
    return Judgement(fraction, "\n".join([header, *rows, *_local_rows(local)]), details)


def _local_figures(local: LocalTime) -> dict[str, Any]:
    if not local.measured:
        return {"measured": False}
    return {
        "measured": True,
        "cpu_seconds": round(local.cpu, 6),
        "outside_seconds": round(local.outside, 6),
        "waiting_seconds": round(local.waiting, 6),
    }


def _local_rows(local: Sequence[LocalTime]) -> list[str]:
    """Where each rank's time went outside its messages: told, not yet judged."""
    if not local:
        return []
    if not all(t.measured for t in local):
        return ["  local time: not measured here (a rank on another node, or no schedstat)"]
    busiest = max(range(len(local)), key=lambda r: local[r].cpu + local[r].outside)
    t = local[busiest]
    return [
        f"  local time (told, not judged): rank {busiest} spent {duration(t.cpu)} computing, "
        f"{duration(t.outside)} neither computing nor in a message (a sleep or a wait outside "
        f"torch.distributed), {duration(t.waiting)} waiting for a CPU (the machine's load)"
    ]
