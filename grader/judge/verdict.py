"""A test's verdict: what the trusted grader decided, in typed fields that every report reads.

Only the grader's own process makes verdicts (:mod:`grader.judge.plugin`),
from the graded test's result there: nothing a rank says is a verdict.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from grader import protocol
from grader.failures import Cause

#: What results.json's ``extra_data`` of a test holds of the grader's own
#: (:mod:`grader.report.results`): no figure of a test may take these names.
EXTRA_DATA_KEYS = frozenset(
    {"part", "test", "target", "world_size", "kind", "outcome", "cause", "seconds", "fraction"}
)


class Pass(enum.Enum):
    """Which way a microbatch goes through a pipeline stage."""

    FORWARD = "F"
    BACKWARD = "B"


class Cell(NamedTuple):
    """One step of a stage's timeline: a pass of one microbatch, written ``F3`` or ``B1``."""

    kind: Pass
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.microbatch}"

    @property
    def forward(self) -> bool:
        return self.kind is Pass.FORWARD


def forward(microbatch: int) -> Cell:
    return Cell(Pass.FORWARD, microbatch)


def backward(microbatch: int) -> Cell:
    return Cell(Pass.BACKWARD, microbatch)


Timeline = list[list[Cell]]  # one row of cells per rank


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule test's timelines: the order of work the broker's record shows on
    each stage, and what the schedule says."""

    actual: Timeline
    expected: Timeline


class Work(enum.Enum):
    """What a rank of ring attention does with the K/V block it holds at one step."""

    WHOLE = "whole"  # every key is visible: the whole block's scores count
    DIAGONAL = "diagonal"  # the rank's own block under a causal mask: the triangle only
    SKIPPED = "skipped"  # causal, and every key is in the future: passed on, not computed

    @property
    def symbol(self) -> str:
        return {"whole": "", "diagonal": "tri", "skipped": "skip"}[self.value]


@dataclass(frozen=True)
class RingCell:
    """One rank at one step of the ring: whose block it held, by the broker, and the rule's."""

    held: int | None  # the owner of the block the broker carried here (None: none arrived)
    expected: int  # the owner of the block a ring hands this rank at this step
    work: Work  # what the rank does with the expected block

    @property
    def right(self) -> bool:
        return self.held == self.expected

    @property
    def text(self) -> str:
        held = "?" if self.held is None else f"KV{self.held}"
        return f"{held} {self.work.symbol}".strip()


@dataclass(frozen=True)
class Ring:
    """Ring attention's forward, rank by rank (rows) and step by step (columns)."""

    cells: list[list[RingCell]]
    causal: bool


@dataclass(frozen=True)
class Verdict:
    outcome: str
    message: str = ""
    fraction: float | None = None  # partial credit of a cost test, in [0, 1]
    details: dict[str, Any] = field(default_factory=dict)  # figures for results.json
    schedule: Schedule | None = None
    ring: Ring | None = None
    seconds: float = 0.0
    case: str = ""  # the input case a failed call ran on, which its message names at the end
    cause: Cause | None = None  # what a failure is, for machines; None when it passed
    check: str = ""  # which check of the cause failed (its place in the graded test), if known

    @property
    def passed(self) -> bool:
        return self.outcome == protocol.PASSED

    def share(self) -> float:
        """The share of the test's points it earned."""
        if self.fraction is not None and self.outcome in (protocol.PASSED, protocol.FAILED):
            return min(1.0, max(0.0, self.fraction))
        return 1.0 if self.passed else 0.0
