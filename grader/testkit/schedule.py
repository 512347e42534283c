"""The pipeline schedules the graded tests hold a stage to, as data (the way
``torch.distributed.pipelining`` makes its schedules): the order of forwards and backwards
each prescribes, and what a stage's timeline, or the broker's record of its messages, shows
it did instead.

A timeline is a list of :class:`~grader.judge.verdict.Cell`: ``F3`` the forward of
microbatch 3, ``B3`` its backward. GPipe runs every forward before any backward, and the
backwards in forward order; 1F1B runs ``min(p - r - 1, m)`` warm-up forwards on stage
``r``, then one forward and one backward in turn, then the remaining backwards, so that at
most ``p - r`` microbatches' activations are alive at once.
"""

from __future__ import annotations

import enum

from grader.broker.traffic import Traffic
from grader.judge.verdict import Cell, backward, forward


class PipelineSchedule(enum.Enum):
    """A schedule the pipeline_parallel part grades, by the function that runs it."""

    GPIPE = "gpipe_step"
    ONE_F_ONE_B = "one_f_one_b_step"

    def order(self, p: int, rank: int, m: int) -> list[Cell]:
        """What stage ``rank`` of ``p`` runs for ``m`` microbatches."""
        if self is PipelineSchedule.GPIPE:
            return gpipe_order(p, rank, m)
        return one_f_one_b_order(p, rank, m)

    def problem(self, timeline: list[Cell], p: int, rank: int, m: int) -> str | None:
        """What is wrong with stage ``rank``'s timeline, or None."""
        if self is PipelineSchedule.GPIPE:
            return gpipe_problem(timeline, p, rank, m)
        return one_f_one_b_problem(timeline, p, rank, m)


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


def count_problem(timeline: list[Cell], rank: int, m: int) -> str | None:
    forwards = sum(cell.forward for cell in timeline)
    if forwards != m:
        return f"stage {rank} ran {forwards} forwards for {m} microbatches: one per microbatch"
    for i in range(m):
        runs = timeline.count(backward(i))
        if runs != 1:
            done = f"backpropagated microbatch {i} (B{i}) {runs} times"
            done = f"never backpropagated microbatch {i} (B{i})" if runs == 0 else done
            return f"stage {rank} {done}: each microbatch takes one backward"
    return None


def gpipe_problem(timeline: list[Cell], p: int, rank: int, m: int) -> str | None:
    problem = count_problem(timeline, rank, m)
    if problem:
        return problem
    first = next(j for j, cell in enumerate(timeline) if not cell.forward)
    late = [cell for cell in timeline[first:] if cell.forward]
    if late:
        return (
            f"stage {rank} ran {late[0]} after {timeline[first]}: "
            f"GPipe runs every forward before any backward"
        )
    backwards = timeline[first:]
    for i, cell in enumerate(backwards):
        if cell != backward(i):
            order = (
                "in reverse order" if backwards == [backward(j) for j in reversed(range(m))] else ""
            )
            return (
                f"stage {rank} ran {cell} before B{i}{' (' + order + ')' if order else ''}: "
                "GPipe backpropagates in forward order, microbatch 0 first"
            )
    return None


def one_f_one_b_problem(timeline: list[Cell], p: int, rank: int, m: int) -> str | None:
    problem = count_problem(timeline, rank, m)
    expected = one_f_one_b_order(p, rank, m)
    if problem or timeline == expected:
        return problem
    warmup, limit, rule = min(p - rank - 1, m), p - rank, one_f_one_b_rule(p, rank, m)
    ahead = next(j for j, cell in enumerate(timeline) if not cell.forward)
    if ahead != min(warmup + 1, m):
        ran = f"{'only ' if ahead < warmup + 1 else ''}{ahead} microbatch{'es' * (ahead > 1)}"
        return f"stage {rank} ran {ran} forward before its first backward; {rule}"
    in_flight = 0
    for cell in timeline:
        in_flight += 1 if cell.forward else -1
        if in_flight > limit:
            return f"stage {rank} had {in_flight} microbatches in flight after {cell}; {rule}"
    backwards = [cell for cell in timeline if not cell.forward]
    for i, cell in enumerate(backwards):
        if cell != backward(i):
            return f"stage {rank} ran {cell} before B{i}: 1F1B backpropagates in forward order"
    j = next(j for j, (a, b) in enumerate(zip(timeline, expected, strict=True)) if a != b)
    return (
        f"stage {rank} ran {timeline[j]} at step {j} where 1F1B runs {expected[j]}: {rule} "
        f"(expected {' '.join(map(str, expected))}; ran {' '.join(map(str, timeline))})"
    )


def recorded(raw: object, rank: int) -> tuple[list[Cell], str | None]:
    """Stage ``rank``'s timeline as its recorder wrote it, or why it is not one (the recorder
    runs in the rank's process: anything may come back)."""
    if not isinstance(raw, list):
        return [], f"stage {rank} sent back no timeline"
    cells = [Cell.parse(text) for text in raw]
    if None in cells:
        bad = repr(raw[cells.index(None)])[:40]
        return [], f"stage {rank}'s timeline holds {bad}, which the recorder never writes"
    return cells, None


def in_flight_bound(traffic: Traffic, rank: int) -> int:
    """The fewest microbatches that can have been in flight at once on ``rank`` (trusted).

    From the broker's posting order alone: the i-th activation sent to the next stage
    proves i forwards done, and a backward can only have finished once its gradient's
    receive from the next stage was posted. The last stage sends no activation: 0.
    """
    sent = received = bound = 0
    for e in traffic.per_rank[rank]:
        if e.peer == rank + 1:
            sent, received = sent + (e.op == "send"), received + (e.op == "recv")
            bound = max(bound, sent - received)
    return bound


def message_problem(
    traffic: Traffic, schedule: PipelineSchedule, p: int, rank: int, m: int
) -> str | None:
    """What the broker's own record of ``rank``'s messages proves wrong with its schedule.

    Trusted, but partial: message counts on every stage; for 1F1B, the in-flight bound
    (:func:`in_flight_bound`) on every stage but the last; for GPipe, on every stage but the
    first, a gradient sent back (a backward done) before the last activation's receive was
    posted (a forward still to come).
    """
    record = " (the broker's record of its messages)"
    events = traffic.per_rank[rank]
    for peer, what in ((rank + 1, "activations"), (rank - 1, "gradients")):
        if not 0 <= peer < p:
            continue
        sent = sum(e.op == "send" and e.peer == peer for e in events)
        if sent != m:
            return f"stage {rank} sent {sent} {what} to stage {peer} for {m} microbatches{record}"
    if schedule is PipelineSchedule.ONE_F_ONE_B and rank < p - 1:
        bound = in_flight_bound(traffic, rank)
        if bound > p - rank:
            return (
                f"stage {rank} sent {bound} activations to stage {rank + 1} beyond the "
                f"gradients it had asked back, so {bound} microbatches were in flight{record}; "
                + one_f_one_b_rule(p, rank, m)
            )
    if schedule is PipelineSchedule.GPIPE and rank > 0:
        received = 0
        for e in events:
            received += e.op == "recv" and e.peer == rank - 1
            if e.op == "send" and e.peer == rank - 1 and received < m:
                return (
                    f"stage {rank} sent a gradient back to stage {rank - 1} before receiving "
                    f"microbatch {received}'s activation{record}: GPipe runs every forward "
                    "before any backward"
                )
    return None
