"""A test's verdict: what the trusted grader decided, in typed fields that every report reads.

Only the grader's own process makes verdicts (:mod:`grader.judge.plugin`),
from the graded test's result there: nothing a rank says is a verdict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grader import protocol

Timeline = list[list[str]]  # one row of cells ("F3", "B1") per rank


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule test's timelines: what the ranks did, and what the schedule says."""

    actual: Timeline
    expected: Timeline


@dataclass(frozen=True)
class Verdict:
    outcome: str
    message: str = ""
    fraction: float | None = None  # partial credit of a cost test, in [0, 1]
    details: dict[str, Any] = field(default_factory=dict)  # figures for results.json
    schedule: Schedule | None = None
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.outcome == protocol.PASSED

    def share(self) -> float:
        """The share of the test's points it earned."""
        if self.fraction is not None and self.outcome in (protocol.PASSED, protocol.FAILED):
            return min(1.0, max(0.0, self.fraction))
        return 1.0 if self.passed else 0.0
