"""The public testkit of the graded tests: all a graded test imports from the grader.

A graded test runs in the grader's own process and drives the ranks::

    @pytest.mark.graded(target="collectives.all_reduce", kind="correctness")
    def test_all_reduce(world):
        inputs = [rank_tensor("all_reduce", r, (5,), torch.float32) for r in range(world.size)]
        out = world.call("collectives.all_reduce", [(x.clone(),) for x in inputs])
        check_close(out.args[0][0], sum(inputs), "all_reduce")
"""

from grader import failures
from grader.broker.ops import Gate
from grader.broker.traffic import Event, Traffic
from grader.course.options import TestOptions
from grader.judge.call import CallResult
from grader.judge.verdict import Cell, Ring, RingCell, Work, backward, forward
from grader.launch.world import World
from grader.protocol import OpName
from grader.testkit.compare import (
    check_close,
    check_unchanged,
    on_every_rank,
    require,
    sums_in_float64,
)
from grader.testkit.data import generator, rank_tensor
from grader.testkit.information import check_informed
from grader.testkit.record import TestRecord
from grader.testkit.timing import stage_timing

__all__ = [
    "CallResult",
    "Cell",
    "Event",
    "Gate",
    "OpName",
    "Ring",
    "RingCell",
    "TestOptions",
    "TestRecord",
    "Traffic",
    "Work",
    "World",
    "backward",
    "check_close",
    "check_informed",
    "check_unchanged",
    "failures",
    "forward",
    "generator",
    "on_every_rank",
    "rank_tensor",
    "require",
    "stage_timing",
    "sums_in_float64",
]
