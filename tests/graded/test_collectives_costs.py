"""Graded tests of what each collective costs, judged from the messages the broker carried.

``communication``: the bytes the busiest rank moves and the rounds, against the
classic lower bounds (``grader/judge/communication.py``).

``performance``: the message pattern replayed on models of real machines
(``grader/judge/machines.yaml``) against the reference's pattern of the same
call (``grader/judge/reference_traces.json``), and the local work of every
rank (its CPU time, and time it spent neither computing nor in a message),
from the kernel's accounting, against the reference's, run beside it on this
machine (``grader/testkit/costs.py``). A warm-up call on other inputs comes
first, on both sides.

Both check the call's result first, like any other test: a fast wrong answer
earns nothing. The communication judgement is deterministic, the same on
every machine and every run; the local work is timed in CPU time, which the
machine's load does not change, against the reference's on the same CPU.
"""

from __future__ import annotations

import pytest

from grader.testkit import CallResult, TestOptions, TestRecord, World, check_close
from grader.testkit.calls import COLLECTIVES, Expected, collective_call, output
from grader.testkit.costs import (
    judge_communication,
    judge_performance,
    reference_messages,
    time_calls,
)


def checked_call(world: World, function: str, n: int) -> CallResult:
    args, expected = collective_call(function, world.size, n)
    out = world.call(f"collectives.{function}", args, case=f"{function} of {n} float32 elements")
    check_outputs(out, expected, function, n, world.size)
    return out


def check_outputs(out: CallResult, expected: list[Expected], function: str, n: int, p: int) -> None:
    what = f"{function} of {n} float32 elements"
    for want in expected:
        got = output(out.args, want)
        check_close(got, want.value, f"rank {want.rank}: {what}", magnitude=want.magnitude, terms=p)


@pytest.mark.parametrize("function", COLLECTIVES)
@pytest.mark.graded(target="collectives.{function}", kind="communication")
def test_communication(
    function: str, world: World, options: TestOptions, record: TestRecord
) -> None:
    n = options.need("communication_elements")
    out = checked_call(world, function, n)
    judged = judge_communication(
        function,
        world.size,
        n * 4,
        out.traffic.messages(),
        reference_messages(function, world.size, n),
        options.bytes_ratio(function),
    )
    record.details.update(judged.details)
    record.credit(judged.fraction, judged.message)


@pytest.mark.parametrize("function", COLLECTIVES)
@pytest.mark.graded(target="collectives.{function}", kind="performance")
def test_performance(
    function: str, world: World, reference: World | None, options: TestOptions, record: TestRecord
) -> None:
    n = options.need("performance_elements")
    timing = time_calls(
        function,
        n,
        world,
        reference,
        lambda out, expected: check_outputs(out, expected, function, n, world.size),
        options.full_points_within,
        options.local_allowance_ms / 1e3,
    )
    judged = judge_performance(
        function,
        world.size,
        n * 4,
        timing.out.traffic.messages(),
        reference_messages(function, world.size, n),
        options.full_points_within,
        options.zero_points_beyond,
        timing.yours,
        timing.reference,
        options.local_allowance_ms / 1e3,
    )
    record.details.update(judged.details)
    record.credit(judged.fraction, judged.message)
