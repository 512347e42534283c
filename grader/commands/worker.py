"""A batch's grader: one ``grader run`` that grades student after student.

``grader batch`` starts one per ``--jobs`` (``grader run ... --batch-worker FD``) and hands
it students one at a time on its standard input, a JSON line each::

    {"submission": DIR, "results": FILE, "log": FILE}

Each is graded as ``grader run --submission DIR --results FILE`` would grade it, everything
it prints going to ``log``, and answered on descriptor FD with ``{"status": N}``, N being that
command's exit status. What start-up costs is paid once for all the students a worker grades:
the interpreter and torch, the graded tests' collection, the sandbox level's probe, and the
reference's job that performance tests time against (the trusted side's own, driven on the
same inputs as in a run of one student). Nothing that isolates one student from another is
shared: each student gets a fresh block of uids
(:meth:`grader.launch.workspace.Workspace.renew_identity`), a fresh job of ranks and a fresh
copy of its files, and the last student's job folders are removed. Any other end than a
verdict (an error, an interrupt) ends the worker: the batch starts a fresh one for the next.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from grader.course.submission import SubmissionError, resolve
from grader.launch.workspace import Workspace

#: What a worker's exit statuses mean, as ``grader run``'s do.
PASSED, FAILED = 0, 1
CANNOT_GRADE = 2

Grade = Callable[[Path, Path], int]  # (submission, results file) -> exit status


def serve(
    requests: Iterable[str], reply_fd: int, workspace: Workspace, grade: Grade, modules: list[str]
) -> int:
    """Grade each request of ``requests`` with ``grade`` (a submission holding some of
    ``modules``), answering on ``reply_fd``; returns the exit status of the first grading
    that was not a verdict, else 0 at the end of input."""
    first = True
    for line in requests:
        request = json.loads(line)
        with _output_to(Path(request["log"])):
            if not first:
                _fresh_ranks(workspace)
            first = False
            status = _grade_one(request, grade, modules)
        os.write(reply_fd, json.dumps({"status": status}).encode() + b"\n")
        if status not in (PASSED, FAILED):
            return status
    return PASSED


def _grade_one(request: dict[str, str], grade: Grade, modules: list[str]) -> int:
    try:
        submission = resolve(request["submission"], modules)
    except SubmissionError as err:
        print(f"grader: error: {err}", file=sys.stderr)
        return CANNOT_GRADE
    return grade(submission, Path(request["results"]))


def _fresh_ranks(workspace: Workspace) -> None:
    """What the last student's ranks had is theirs alone: their uids (given back, every
    process of theirs ended, every file they left where anyone may write removed), their
    jobs' folders."""
    workspace.renew_identity()
    for folder in workspace.work.glob("job*"):
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _output_to(log: Path) -> Iterator[None]:
    """Standard output and error appended to ``log`` for the block, at the descriptor level:
    what a library or a child prints lands there too."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
