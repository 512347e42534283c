"""What a graded test reports beside its outcome: figures, partial credit, a schedule."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grader.judge.verdict import Ring


class PartialCredit(AssertionError):
    """The test earned part of its points; the message says what the rest needs."""


@dataclass
class TestRecord:
    details: dict[str, Any] = field(default_factory=dict)  # shown in results.json extra_data
    fraction: float | None = None
    message: str = ""  # shown even when the test passed (a cost test's table)
    schedule: tuple[list[list[str]], list[list[str]]] | None = None  # (actual, expected)
    ring: Ring | None = None  # ring attention's steps, from the broker's record

    def credit(self, fraction: float, message: str) -> None:
        """Award ``fraction`` of the points: full credit passes, less fails with ``message``."""
        self.fraction = min(1.0, max(0.0, fraction))
        self.message = message
        if self.fraction < 1.0:
            raise PartialCredit(message)
