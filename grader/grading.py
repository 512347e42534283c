"""One grading run: the tests of the selected parts, one torchrun job per world size.

Parts that cannot run at all (a missing or syntactically broken file) get
their verdicts here, without a job; the rest run world size by world size,
every part's tests of one world size in the same job.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from grader import protocol
from grader.catalog import GradedTest
from grader.judge.costs import COST_KINDS, assess, gate
from grader.judge.verdict import Verdict
from grader.launch.supervisor import Supervisor, SupervisorSettings
from grader.report.results import GradedResult
from grader.submission import problem_with, stage


@dataclass
class Listener:
    """What the terminal wants to hear while grading runs."""

    on_start: Callable[[GradedTest], None] = lambda test: None
    on_verdict: Callable[[GradedTest, Verdict], None] = lambda test, verdict: None


def choose_backend(requested: str, world_size: int) -> str:
    """gloo on CPU; NCCL when asked, or on ``auto`` when there is a GPU for every rank."""
    if requested != "auto":
        return requested
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def score(test: GradedTest, verdict: Verdict) -> float:
    """Full points for a pass; a cost test earns the fraction its judge gave it."""
    if test.kind in COST_KINDS and verdict.outcome in (protocol.PASSED, protocol.FAILED):
        fraction = float(verdict.extra.get("fraction", 1.0 if verdict.passed else 0.0))
        return test.settings.points * min(1.0, max(0.0, fraction))
    return test.settings.points if verdict.passed else 0.0


def grade(
    tests: list[GradedTest],
    submission: Path,
    backend: str,
    listener: Listener,
) -> tuple[list[GradedResult], bool]:
    """Grade ``tests``: one result per test, in their order, and whether grading was interrupted.

    On Ctrl-C or SIGTERM, every job is killed (each one's context manager
    does it) and the tests not yet judged are reported as not run.
    """
    verdicts: dict[str, Verdict] = {}
    known: dict[str, tuple[GradedTest, Verdict]] = {}

    def record(test: GradedTest, verdict: Verdict) -> None:
        verdict = gate(test, assess(test, verdict), known)
        verdicts[test.id] = verdict
        known[test.id] = (test, verdict)
        listener.on_verdict(test, verdict)

    runnable = []
    problems = {
        part: problem_with(submission, part) for part in dict.fromkeys(t.part for t in tests)
    }
    for test in tests:
        problem = problems[test.part]
        if problem is None:
            runnable.append(test)
        else:
            record(test, Verdict(problem[0], problem[1]))

    interrupted = False
    try:
        if runnable:
            with tempfile.TemporaryDirectory(prefix="grader-") as work:
                work_dir = Path(work).resolve()
                import_dir = work_dir / "import"
                stage(submission, import_dir)
                supervisor = Supervisor(
                    SupervisorSettings(import_dir, work_dir), record, listener.on_start
                )
                for world_size in sorted({t.world_size for t in runnable}):
                    supervisor.run(
                        [t for t in runnable if t.world_size == world_size],
                        world_size,
                        choose_backend(backend, world_size),
                    )
    except KeyboardInterrupt:
        interrupted = True
    for test in tests:
        if test.id not in verdicts:
            verdicts[test.id] = Verdict(protocol.NOT_RUN, "not run: grading was interrupted")
    return [GradedResult(t, verdicts[t.id], score(t, verdicts[t.id])) for t in tests], interrupted
