"""Gradescope's results.json, written by the supervising grader alone, after every job has ended.

See CONTRACT section 4 and https://gradescope-autograders.readthedocs.io/en/latest/specs/.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grader.catalog import GradedTest
from grader.judge.verdict import Verdict


@dataclass(frozen=True)
class GradedResult:
    test: GradedTest
    verdict: Verdict
    score: float

    @property
    def max_score(self) -> float:
        return self.test.settings.points


def to_gradescope(results: list[GradedResult], seconds: float, summary: str) -> dict[str, Any]:
    return {
        "score": round(sum(r.score for r in results), 4),
        "execution_time": round(seconds, 1),
        "output": summary,
        "output_format": "text",
        "tests": [_test_entry(number, r) for number, r in enumerate(results, start=1)],
    }


def _test_entry(number: int, result: GradedResult) -> dict[str, Any]:
    test, verdict = result.test, result.verdict
    extra = {k: v for k, v in verdict.extra.items() if k != "waiting_for"}
    return {
        "number": str(number),
        "name": test.title,
        "score": round(result.score, 4),
        "max_score": test.settings.points,
        "status": "passed" if verdict.passed else "failed",
        "output": verdict.message or "passed",
        "visibility": test.settings.visibility,
        "tags": [test.part, test.kind],
        "extra_data": {
            **extra,
            "part": test.part,
            "target": test.target,
            "world_size": test.world_size,
            "kind": test.kind,
            "outcome": verdict.outcome,
            "seconds": round(verdict.seconds, 3),
        },
    }


def write_results(path: Path, document: dict[str, Any]) -> None:
    """Write atomically: a reader never sees half a file, and a student's file is replaced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".results-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(document, f, indent=2)
        f.write("\n")
    os.replace(temporary, path)
