"""Grading what an implementation costs: its messages and its time.

The ranks only record (their messages, their per-iteration times); the
judgement needs every rank's record at once, so it is made here, in the
supervising process, after :func:`grader.judge.verdict.judge`. Both kinds earn
points only where the correctness tests of the same target passed: a fast
wrong answer is worth nothing.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

from grader import protocol
from grader.catalog import GradedTest
from grader.judge import communication
from grader.judge.projection import machines, project
from grader.judge.verdict import Verdict
from grader.report.units import duration, size

COST_KINDS = ("communication", "performance")


def must_pass_first(cost: GradedTest, other: GradedTest) -> bool:
    """Whether ``other`` is a correctness test that ``cost`` waits on: same target, same size."""
    return (
        cost.kind in COST_KINDS
        and other.kind == "correctness"
        and (other.target, other.world_size) == (cost.target, cost.world_size)
    )


def gate(
    test: GradedTest, verdict: Verdict, known: dict[str, tuple[GradedTest, Verdict]]
) -> Verdict:
    """``not_run`` unless every correctness test of the same target and world size passed."""
    failed = [
        other
        for other, other_verdict in known.values()
        if must_pass_first(test, other) and not other_verdict.passed
    ]
    if not failed:
        return verdict
    return Verdict(
        protocol.NOT_RUN,
        f"not graded: {failed[0].name} (world size {test.world_size}) must pass first",
        verdict.extra,
        verdict.seconds,
    )


def assess(test: GradedTest, verdict: Verdict) -> Verdict:
    """Turn the ranks' records of a cost test into its verdict and its share of the points."""
    if not verdict.passed or test.kind not in COST_KINDS:
        return verdict
    per_rank = verdict.extra.get("per_rank") or []
    # Only the tests that recorded a collective's messages or times are judged here;
    # any other test of these kinds judged itself on its ranks.
    if test.kind == "communication" and "communication" in verdict.extra:
        return _communication(test, verdict, per_rank)
    if test.kind == "performance" and per_rank and "student_times" in (per_rank[0] or {}):
        return _performance(test, verdict, per_rank)
    return verdict


def _communication(test: GradedTest, verdict: Verdict, per_rank: list[Any]) -> Verdict:
    info = verdict.extra["communication"]
    function, n_bytes, p = info["function"], info["n_bytes"], test.world_size
    mine = communication.figures([r["student"] for r in per_rank])
    theirs = communication.figures([r["reference"] for r in per_rank])
    bound = communication.bound_bytes(function, p, n_bytes)
    allowed_by = test.settings.options.get("max_bytes_ratio", 1.0)
    allowed = float(allowed_by.get(function, 1.0) if isinstance(allowed_by, dict) else allowed_by)
    ratio = mine.busiest_bytes / bound if bound else 1.0
    projections = {
        m.name: {
            "student_seconds": project([r["student"] for r in per_rank], m),
            "reference_seconds": project([r["reference"] for r in per_rank], m),
        }
        for m in machines()
    }
    extra = {
        **{k: v for k, v in verdict.extra.items() if k != "per_rank"},
        "student": mine.as_dict(),
        "reference": theirs.as_dict(),
        "bound_bytes": bound,
        "bytes_ratio": round(ratio, 4),
        "min_rounds": communication.min_rounds(p),
        "projected": projections,
        "fraction": 1.0 if ratio <= allowed + 1e-9 else 0.0,
    }
    table = _communication_table(function, p, n_bytes, mine, theirs, bound, projections)
    if ratio <= allowed + 1e-9:
        return replace(verdict, message=table, extra=extra)
    advice = (
        f"the busiest rank (rank {mine.busiest_rank}) moves {ratio:.2f}x the bound; "
        f"at most {allowed:g}x earns the points"
    )
    return Verdict(protocol.FAILED, f"{advice}\n{table}", extra, verdict.seconds)


def _communication_table(function, p, n_bytes, mine, theirs, bound, projections) -> str:
    rows = [
        f"{function} of {size(n_bytes)} on {p} ranks      yours      reference  bound",
        f"  busiest rank moves            {size(mine.busiest_bytes):>9}"
        f"  {size(theirs.busiest_bytes):>9}  {size(bound):>9}",
        f"  ratio to the bound            {mine.busiest_bytes / bound if bound else 1:>9.2f}"
        f"  {theirs.busiest_bytes / bound if bound else 1:>9.2f}       1.00",
        f"  messages                      {mine.messages:>9}  {theirs.messages:>9}",
        f"  rounds                        {mine.rounds:>9}  {theirs.rounds:>9}"
        f"  >= {communication.min_rounds(p)}",
    ]
    for name, times in projections.items():
        rows.append(
            f"  projected on {name:<17}{duration(times['student_seconds']):>9}"
            f"  {duration(times['reference_seconds']):>9}"
        )
    return "\n".join(rows)


def _performance(test: GradedTest, verdict: Verdict, per_rank: list[Any]) -> Verdict:
    """Median of the paired ratios student/reference, each iteration timed by its slowest rank."""
    options = test.settings.options
    full_at = float(options.get("full_points_within", 1.5))
    zero_at = float(options.get("zero_points_beyond", 3.0))
    student = [max(t) for t in zip(*(r["student_times"] for r in per_rank), strict=True)]
    reference = [max(t) for t in zip(*(r["reference_times"] for r in per_rank), strict=True)]
    ratio = statistics.median(s / r for s, r in zip(student, reference, strict=False))
    fraction = 1.0 if ratio <= full_at else max(0.0, (zero_at - ratio) / (zero_at - full_at))
    info = verdict.extra.get("performance", {})
    function, n_bytes = info.get("function", test.target), info.get("n_bytes", 0)
    factor = communication.BUS_FACTOR.get(function, lambda p: 1.0)(test.world_size)
    mine_s, ref_s = statistics.median(student), statistics.median(reference)
    extra = {
        **{k: v for k, v in verdict.extra.items() if k != "per_rank"},
        "time_ratio": round(ratio, 3),
        "student_seconds": mine_s,
        "reference_seconds": ref_s,
        "student_algbw_GBps": n_bytes / mine_s / 1e9,
        "student_busbw_GBps": n_bytes / mine_s / 1e9 * factor,
        "reference_algbw_GBps": n_bytes / ref_s / 1e9,
        "reference_busbw_GBps": n_bytes / ref_s / 1e9 * factor,
        "fraction": round(fraction, 4),
    }
    table = (
        f"{function} of {size(n_bytes)} on {test.world_size} ranks: yours {duration(mine_s)} "
        f"(algbw {extra['student_algbw_GBps']:.3f}, busbw {extra['student_busbw_GBps']:.3f} GB/s), "
        f"reference {duration(ref_s)} (algbw {extra['reference_algbw_GBps']:.3f}, "
        f"busbw {extra['reference_busbw_GBps']:.3f} GB/s): {ratio:.2f}x the reference's time "
        f"(median of {len(student)} paired runs; full points within {full_at:g}x, "
        f"none beyond {zero_at:g}x)"
    )
    outcome = protocol.PASSED if fraction >= 1.0 else protocol.FAILED
    return Verdict(outcome, table, extra, verdict.seconds)
