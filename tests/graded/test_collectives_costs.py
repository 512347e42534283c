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

from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from grader.rank.context import TestContext
from grader.testkit import rank_tensor
from grader.testkit.timing import paired_times

FUNCTIONS = (
    "broadcast",
    "reduce",
    "all_reduce",
    "scatter",
    "gather",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
)
ROOT = 0


def call_of(module: ModuleType, function: str, rank: int, world_size: int, n: int) -> Callable[[], None]:
    """A call of ``module.function`` on n float32 elements in all (the nccl-tests convention).

    n is the whole array: the tensor of a broadcast, reduce or all-reduce; the
    concatenation of the pieces of the list-based operations.
    """
    piece = n // world_size
    fn = getattr(module, function)
    data = rank_tensor(f"costs/{function}", rank, (n,), torch.float32)
    pieces = [rank_tensor(f"costs/{function}/{r}", rank, (piece,), torch.float32) for r in range(world_size)]
    empty = [torch.empty(piece) for _ in range(world_size)]
    calls = {
        "broadcast": lambda: fn(data.clone(), ROOT),
        "reduce": lambda: fn(data.clone(), ROOT),
        "all_reduce": lambda: fn(data.clone()),
        "scatter": lambda: fn(torch.empty(piece), pieces if rank == ROOT else None, ROOT),
        "gather": lambda: fn(pieces[0], empty if rank == ROOT else None, ROOT),
        "all_gather": lambda: fn(empty, pieces[0]),
        "reduce_scatter": lambda: fn(torch.empty(piece), pieces),
        "all_to_all": lambda: fn(empty, pieces),
    }
    return calls[function]


@pytest.mark.parametrize("function", FUNCTIONS)
@pytest.mark.graded(target="collectives.{function}", kind="communication")
def test_communication(
    function: str,
    student: ModuleType,
    reference: ModuleType,
    ctx: TestContext,
    rank: int,
    world_size: int,
    options: dict,
) -> None:
    n = int(options.get("communication_elements", 12 * 4096))
    with ctx.recording() as mine:
        call_of(student, function, rank, world_size, n)()
    ctx.barrier()
    with ctx.recording() as theirs:
        call_of(reference, function, rank, world_size, n)()
    ctx.extra["communication"] = {"function": function, "n_bytes": n * 4}
    ctx.extra["per_rank"] = {"student": mine.messages(), "reference": theirs.messages()}


@pytest.mark.parametrize("function", FUNCTIONS)
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
        call_of(student, function, rank, world_size, n),
        call_of(reference, function, rank, world_size, n),
        ctx.barrier,
        device,
        iterations=int(options.get("iterations", 7)),
        warmup=int(options.get("warmup", 2)),
    )
    ctx.extra["performance"] = {"function": function, "n_bytes": n * 4}
    ctx.extra["per_rank"] = {"student_times": mine, "reference_times": theirs}
