"""What a graded test reports beside its outcome: figures, partial credit, a schedule."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from grader.failures import GraderFailure
from grader.judge.verdict import EXTRA_DATA_KEYS, Ring


class PartialCredit(AssertionError):
    """The test earned part of its points; the message says what the rest needs."""


class Details(MutableMapping[str, Any]):
    """A test's figures for results.json's ``extra_data``, beside the grader's own keys
    (:data:`EXTRA_DATA_KEYS`), which a figure may not take: the course's mistake, not the
    student's, ends the run (:class:`GraderFailure`)."""

    def __init__(self) -> None:
        self._figures: dict[str, Any] = {}

    def __setitem__(self, key: str, value: Any) -> None:
        if key in EXTRA_DATA_KEYS:
            raise GraderFailure(
                f"a graded test reports a figure named {key!r}, which results.json's "
                "extra_data keeps for the grader's own: the test must name it otherwise"
            )
        self._figures[key] = value

    def __getitem__(self, key: str) -> Any:
        return self._figures[key]

    def __delitem__(self, key: str) -> None:
        del self._figures[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._figures)

    def __len__(self) -> int:
        return len(self._figures)


@dataclass
class TestRecord:
    details: Details = field(default_factory=Details)  # shown in results.json extra_data
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
