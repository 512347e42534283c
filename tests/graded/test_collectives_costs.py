"""Graded tests of what each collective costs: its messages, and its time against the reference.

``communication``: every rank logs the messages of one call of the student's
function and one of the reference's; the grader counts the bytes of the
busiest rank and the rounds, and compares them with the classic lower bounds
(``grader/judge/communication.py``). Deterministic: the same on every machine.

``performance``: the student's and the reference's functions run alternately
in this job after a warm-up; the grader takes each iteration's slowest rank
and the median of the paired ratios (``grader/judge/costs.py``).

Both earn points only where the correctness test of the same function passed.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from grader.rank.context import TestContext
from grader.testkit.calls import COLLECTIVES, collective_call
from grader.testkit.timing import paired_times


@pytest.mark.parametrize("function", COLLECTIVES)
@pytest.mark.graded(target="collectives.{function}", kind="communication")
def test_communication(
    function: str,
    student: ModuleType,
    reference: ModuleType,
    ctx: TestContext,
    rank: int,
    world_size: int,
    device: torch.device,
    options: dict,
) -> None:
    n = int(options.get("communication_elements", 12 * 4096))
    with ctx.recording() as mine:
        collective_call(student, function, rank, world_size, n, device)()
    ctx.barrier()
    with ctx.recording() as theirs:
        collective_call(reference, function, rank, world_size, n, device)()
    ctx.extra["communication"] = {"function": function, "n_bytes": n * 4}
    ctx.extra["per_rank"] = {"student": mine.messages(), "reference": theirs.messages()}


@pytest.mark.parametrize("function", COLLECTIVES)
@pytest.mark.graded(target="collectives.{function}", kind="performance")
def test_performance(
    function: str,
    student: ModuleType,
    reference: ModuleType,
    ctx: TestContext,
    rank: int,
    world_size: int,
    device: torch.device,
    options: dict,
) -> None:
    n = int(options.get("performance_elements", 1 << 20))
    mine, theirs = paired_times(
        collective_call(student, function, rank, world_size, n, device),
        collective_call(reference, function, rank, world_size, n, device),
        ctx.barrier,
        device,
        iterations=int(options.get("iterations", 9)),
        warmup=int(options.get("warmup", 1)),
        repeats=int(options.get("repeats", 3)),
    )
    ctx.extra["performance"] = {"function": function, "n_bytes": n * 4}
    ctx.extra["per_rank"] = {"student_times": mine, "reference_times": theirs}
