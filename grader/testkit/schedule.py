"""The pipeline schedules the graded tests hold a stage to, as data (the way
``torch.distributed.pipelining`` makes its schedules), judged on the broker's record alone.

GPipe runs every forward before any backward, and the backwards in forward order; 1F1B runs
``min(p - r - 1, m)`` warm-up forwards on stage ``r``, then one forward and one backward in
turn, then the remaining backwards, so that at most ``p - r`` microbatches' activations are
alive at once. Written as cells (:class:`~grader.judge.verdict.Cell`): ``F3`` the forward of
microbatch 3, ``B3`` its backward.

Nothing a rank reports is read. Every message a stage sends is identified by what it holds,
against the trusted side's activations and gradients (:mod:`grader.testkit.messages`), and
bounds one pass (:class:`Bounds`): ``Fj`` cannot start before the stage had microbatch
``j``'s input (stage 0 where it passed the gate "microbatch j", which hands the rows over;
the others where the broker handed them activation ``j``, not where they asked for it), and
was done when activation ``j`` was sent on; ``Bk`` cannot start before gradient ``k`` was
handed over (on the last stage, before ``Fk``), and was done when the stage sent its
gradient ``k`` back. A record is the schedule's when its passes fit these bounds in the
schedule's order (:func:`order_problem`): every run of the schedule does, and a record that
does is one a run of it could have made. Stage 0's backwards send nothing, so only their
starts are bounded: their order there is not seen.
"""

from __future__ import annotations

import enum

from grader.broker.traffic import Traffic
from grader.judge.verdict import Cell, backward, forward
from grader.testkit.messages import RECORD, Bounds, Expected, read_stage


class PipelineSchedule(enum.Enum):
    """A schedule the pipeline_parallel part grades, by the function that runs it."""

    GPIPE = "gpipe_step"
    ONE_F_ONE_B = "one_f_one_b_step"

    @property
    def title(self) -> str:
        return "GPipe" if self is PipelineSchedule.GPIPE else "1F1B"

    def order(self, p: int, rank: int, m: int) -> list[Cell]:
        """What stage ``rank`` of ``p`` runs for ``m`` microbatches."""
        if self is PipelineSchedule.GPIPE:
            return gpipe_order(p, rank, m)
        return one_f_one_b_order(p, rank, m)

    def why(self, first: Cell, then: Cell, p: int, rank: int, m: int) -> str:
        """The rule that runs ``first`` before ``then`` on stage ``rank``."""
        if self is PipelineSchedule.GPIPE and first.forward and not then.forward:
            return "GPipe runs every forward before any backward"
        rule = f"{self.title} runs {first} before {then}"
        if self is PipelineSchedule.GPIPE:
            return rule
        return f"{rule}; {one_f_one_b_rule(p, rank, m)}"


def gpipe_order(p: int, rank: int, m: int) -> list[Cell]:
    return [forward(i) for i in range(m)] + [backward(i) for i in range(m)]


def one_f_one_b_order(p: int, rank: int, m: int) -> list[Cell]:
    warmup = min(p - rank - 1, m)
    order = [forward(i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [forward(warmup + i), backward(i)]
    return order + [backward(i) for i in range(m - warmup, m)]


def one_f_one_b_rule(p: int, rank: int, m: int) -> str:
    warmup, limit = min(p - rank - 1, m), p - rank
    return (
        f"1F1B's warm-up on stage {rank} of {p} is {warmup} forward{'s' if warmup != 1 else ''}"
        f", then one forward and one backward in turn, so at most {limit} microbatch"
        f"{'es are' if limit > 1 else ' is'} in flight"
    )


def arrival(cell: Cell, rank: int) -> str:
    """What came to stage ``rank`` that ``cell`` needs first."""
    if cell.forward and rank == 0:
        return f"it took microbatch {cell.microbatch}'s rows at the grader's gate"
    what = "activation" if cell.forward else "gradient"
    return f"microbatch {cell.microbatch}'s {what} reached it"


def departure(cell: Cell, rank: int) -> str:
    """The message that shows ``cell`` done on stage ``rank``."""
    if cell.forward:
        return f"sent microbatch {cell.microbatch}'s activation to stage {rank + 1}"
    return f"sent microbatch {cell.microbatch}'s gradient back to stage {rank - 1}"


def order_problem(
    schedule: PipelineSchedule, bounds: Bounds, p: int, rank: int, m: int
) -> str | None:
    """Why stage ``rank``'s passes cannot be placed in the schedule's order within their
    bounds, or None. Each pass goes at the earliest point its inputs and the pass before it
    allow; the first one whose message left before that point names what it came before."""
    at, cause = 0, None
    for cell in schedule.order(p, rank, m):
        start = bounds.start.get(cell)
        if start is not None and start > at:
            at, cause = start, cell
        end = bounds.end.get(cell)
        if end is not None and end < at and cause is not None and cause != cell:
            return (
                f"stage {rank} {departure(cell, rank)} before {arrival(cause, rank)}{RECORD}: "
                + schedule.why(cause, cell, p, rank, m)
            )
    return None


def observed_order(
    schedule: PipelineSchedule, bounds: Bounds, p: int, rank: int, m: int
) -> list[Cell]:
    """The stage's passes in the order the broker saw them: each where its message left (or,
    with none, where its input came), ties in the schedule's order. What the picture draws."""
    expected = schedule.order(p, rank, m)
    seen = {
        cell: bounds.end.get(cell, bounds.start.get(cell))
        for cell in expected
        if cell in bounds.end or cell in bounds.start
    }
    return sorted(seen, key=lambda cell: (seen[cell], expected.index(cell)))


def in_flight_bound(bounds: Bounds, m: int) -> int:
    """The fewest microbatches that were in flight at once on the stage: at each point, those
    whose activation had been sent on and whose gradient had not yet come back (trusted)."""
    sent = [bounds.end.get(forward(j)) for j in range(m)]
    back = [bounds.start.get(backward(j)) for j in range(m)]
    points = [s + 1 for s in sent if s is not None]
    return max(
        (
            sum(
                s is not None and s < at and (b is None or b > at)
                for s, b in zip(sent, back, strict=True)
            )
            for at in points
        ),
        default=0,
    )


def judge_stage(
    traffic: Traffic, schedule: PipelineSchedule, p: int, rank: int, m: int, expected: Expected
) -> tuple[Bounds, str | None]:
    """Stage ``rank``'s bounds, and what the broker's record proves wrong with its schedule."""
    bounds, problem = read_stage(traffic, rank, p, m, expected, schedule.title)
    return bounds, problem or order_problem(schedule, bounds, p, rank, m)
