"""Graded tests of what each collective costs, judged from the messages the broker carried.

``communication``: the bytes the busiest rank moves and the rounds, against the
classic lower bounds (``grader/judge/communication.py``).

``performance``: the message pattern replayed on models of real machines
(``grader/judge/machines.yaml``) against the reference's pattern of the same
call (``grader/judge/reference_traces.json``).

Both check the call's result first, like any other test: a fast wrong answer
earns nothing. Both are deterministic: the same on every machine, every run.
"""

from __future__ import annotations

import pytest

from grader.testkit import CallResult, TestOptions, TestRecord, World, check_close
from grader.testkit.calls import COLLECTIVES, collective_call, output
from grader.testkit.costs import judge_communication, judge_performance, reference_messages


def checked_call(world: World, function: str, n: int) -> CallResult:
    args, expected = collective_call(function, world.size, n)
    what = f"{function} of {n} float32 elements"
    out = world.call(f"collectives.{function}", args, case=what)
    for want in expected:
        got = output(out.args, want)
        check_close(
            got, want.value, f"rank {want.rank}: {what}", magnitude=want.magnitude, terms=world.size
        )
    return out


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
def test_performance(function: str, world: World, options: TestOptions, record: TestRecord) -> None:
    n = options.need("performance_elements")
    out = checked_call(world, function, n)
    judged = judge_performance(
        function,
        world.size,
        n * 4,
        out.traffic.messages(),
        reference_messages(function, world.size, n),
        options.full_points_within,
        options.zero_points_beyond,
        out.traffic.local,
    )
    record.details.update(judged.details)
    record.credit(judged.fraction, judged.message)
