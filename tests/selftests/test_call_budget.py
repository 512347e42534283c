"""One budget for the whole call: what every rank's records, copies and held payloads cost
the grader together stays below a 4 GB container's memory (issue 45).

Each rank's own limits (``grader/broker/ops.py``, ``Limits``) allow 1 GiB of payloads kept
in a call's record; p ranks at the limit would take p GiB. ``dp_floods_the_grader``: with
one bucket, every rank of 4 all-reduces 31 tensors of 32 MiB in a group of its own, 992 MiB
a rank. The rank that passes the call's budget is blamed, that test earns nothing, and the
grader goes on: the next tests, the reference's, pass.
"""

from __future__ import annotations

import resource

DP, GiB = "data_parallel", 1 << 30
HONEST = ("overlap[per_parameter]", "overlap[few_buckets]", "overlap[cap_below_parameter]")


def test_a_flood_within_each_ranks_limits_stops_at_the_calls_budget(grade) -> None:
    graded = grade("dp_floods_the_grader", DP, k="overlap", world_sizes=(4,))
    flooded = graded.test("overlap[one_bucket]", 4, DP)
    assert flooded["score"] == 0, flooded["output"]
    assert (
        "took the grader past its share of the call's budget (384 of 1536 MiB for 4 ranks) with "
        "the all_reduce" in flooded["output"]
    )
    for name in HONEST:  # the grader stayed up, and its next jobs are whole
        test = graded.test(name, 4, DP)
        assert test["score"] == test["max_score"] > 0, (name, test["output"])
    # The largest process this test process waited for (the graders it ran, and their
    # ranks, each within its own limit) never came near a 4 GB container's memory.
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    assert peak < 2.5 * GiB, f"{peak / GiB:.2f} GiB"
