"""Gradescope's results.json, written by the supervising grader alone, after every job has ended.

See docs/results.md and https://gradescope-autograders.readthedocs.io/en/latest/specs/.

Students on Gradescope see the tests marked ``visible``; Gradescope itself hides
the others by their ``visibility``. The top-level ``output`` is always shown,
so it speaks only of the visible tests: a count of the hidden ones would tell.
"""

from __future__ import annotations

import base64
import html
import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grader.course.catalog import GradedTest
from grader.judge.verdict import Verdict
from grader.sandbox import Level

RESULTS_MODE = 0o644  # Gradescope's harness and TAs read it, whoever wrote it


@dataclass(frozen=True)
class GradedResult:
    test: GradedTest
    verdict: Verdict
    score: float
    picture: Path | None = None  # a PNG that shows the failure (a schedule, a ring)

    @property
    def max_score(self) -> float:
        return self.test.settings.points


@dataclass(frozen=True)
class Points:
    """Points earned and possible over some results: the one place where they add up."""

    earned: float
    possible: float

    @classmethod
    def of(cls, results: Iterable[GradedResult]) -> Points:
        results = list(results)
        return cls(sum(r.score for r in results), sum(r.max_score for r in results))

    @property
    def partial(self) -> bool:
        """Some of the points, not all."""
        return 0 < self.earned < self.possible

    def __str__(self) -> str:
        return f"{self.earned:g} / {self.possible:g}"


def student_summary(results: list[GradedResult]) -> str:
    """The top-level ``output``: points and passes of the visible tests only."""
    shown = [r for r in results if r.test.settings.visible]
    passed = sum(r.verdict.passed for r in shown)
    return f"{Points.of(shown)} points; {passed} of {len(shown)} tests passed"


def to_gradescope(
    results: list[GradedResult],
    seconds: float,
    summary: str,
    top_level: dict[str, str] | None = None,
    sandbox: Level = Level.NONE,
    review: list[str] | None = None,
    sandbox_per_node: list[Level] | None = None,
) -> dict[str, Any]:
    """The document; ``top_level`` adds Gradescope's ``visibility``/``stdout_visibility``.

    ``sandbox_per_node``: across nodes, the level each node applied (node 0 first).
    """
    levels = [level.value for level in sandbox_per_node or []]
    per_node = {"sandbox_per_node": levels} if levels else {}
    return {
        "score": round(Points.of(results).earned, 4),
        "execution_time": round(seconds, 1),
        "output": summary,
        "output_format": "text",
        **(top_level or {}),
        "tests": [_test_entry(number, r) for number, r in enumerate(results, start=1)],
        "extra_data": {"sandbox": sandbox.value, **per_node, "review": list(review or [])},
    }


def _test_entry(number: int, result: GradedResult) -> dict[str, Any]:
    test, verdict = result.test, result.verdict
    return {
        "number": str(number),
        "name": test.title,
        "score": round(result.score, 4),
        "max_score": test.settings.points,
        "status": "passed" if verdict.passed else "failed",
        **_output(verdict.message or "passed", result.picture),
        "visibility": test.settings.visibility,
        "tags": [test.part, test.kind],
        "extra_data": {
            **verdict.details,
            "part": test.part,
            "test": test.name,
            "target": test.target,
            "world_size": test.world_size,
            "kind": test.kind,
            "outcome": verdict.outcome,
            **({"cause": verdict.cause} if verdict.cause and not verdict.passed else {}),
            "seconds": round(verdict.seconds, 3),
            **({"fraction": round(verdict.fraction, 4)} if verdict.fraction is not None else {}),
        },
    }


def _output(message: str, picture: Path | None) -> dict[str, str]:
    """A test's ``output``: text, or where a picture shows the failure, Gradescope's HTML
    with the picture embedded (it shows no image that is a file beside results.json)."""
    if picture is None or not picture.is_file():
        return {"output": message, "output_format": "text"}
    image = base64.b64encode(picture.read_bytes()).decode("ascii")
    alt = html.escape(picture.name, quote=True)
    return {
        "output": f"<pre>{html.escape(message)}</pre>\n"
        f'<img alt="{alt}" style="max-width: 100%" src="data:image/png;base64,{image}">',
        "output_format": "html",
    }


class ResultsPathError(Exception):
    """``--results`` names a file that cannot be written; the message is one line."""


def check_writable(path: Path) -> None:
    """Fail before grading, not after minutes of it, when ``path`` cannot be written.

    Tries a real file in its folder: permission bits say nothing of a read-only
    mount, and root passes every ``os.access`` check.
    """
    folder = path.parent
    if path.is_dir():
        raise ResultsPathError(f"--results {path} is a directory, not a file")
    if not folder.is_dir():
        raise ResultsPathError(f"cannot write --results {path}: no such directory {folder}")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".results-probe-")
    except OSError as err:
        raise ResultsPathError(f"cannot write --results {path}: {err.strerror}") from err
    os.close(fd)
    os.unlink(probe)


def write_results(path: Path, document: dict[str, Any]) -> None:
    """Write atomically: a reader never sees half a file, and a student's file is replaced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".results-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(document, f, indent=2)
        f.write("\n")
    os.chmod(temporary, RESULTS_MODE)  # mkstemp makes it 0600
    os.replace(temporary, path)
