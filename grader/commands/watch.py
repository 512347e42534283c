"""``grader run --watch``: regrade the selection each time a file of the submission changes.

One :class:`grader.commands.grading.Session` serves every grading: the sandbox level
is chosen once, the reference's ranks stay up, and the next grading's ranks
are started, torch imported, while the student edits. A regrade then costs
the tests alone. Each grading still stages the files anew and runs them on
fresh processes, in a fresh sandbox: nothing of one grading reaches the next.
Ctrl-C (or SIGTERM) ends every job and removes every file.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from grader.course.submission import fingerprint

if TYPE_CHECKING:
    from grader.commands.grading import Session
    from grader.course.catalog import GradedTest

POLL_SECONDS = 0.1  # how often the submission's files are looked at
SETTLE_SECONDS = 0.05  # an editor may save in steps: regrade once the files stop changing


def watch(
    console: Console, session: Session, tests: list[GradedTest], submission: Path, verbose: bool
) -> None:
    """Grade, print the summary, wait for a change, again, until interrupted (Ctrl-C or
    SIGTERM); then close ``session`` (made ``warm``): every job ended (its
    workspace, and with it every file, is closed by the caller)."""
    from grader.commands.grading import Listener
    from grader.report.terminal import ProgressDisplay, print_summary

    shown = escape(str(submission))
    try:
        with session:
            while True:
                seen = fingerprint(submission)
                console.print(f"Grading [bold]{shown}[/] ({len(tests)} tests)", highlight=False)
                start = time.monotonic()
                with ProgressDisplay(console, len(tests)) as display:
                    listener = Listener(display.on_start, display.on_verdict)
                    run = session.grade(tests, submission, listener)
                seconds = time.monotonic() - start
                if run.interrupted:
                    break
                print_summary(console, run.results, seconds, run.sandbox, run.review, verbose)
                if run.grader_failure:
                    console.print(f"[bold red]grader: error[/]: {escape(run.grader_failure)}")
                console.print(
                    f"[dim]watching {shown} for changes (Ctrl-C to stop)[/]", highlight=False
                )
                wait_for_change(submission, seen)
    except KeyboardInterrupt:
        pass
    console.print("[bold]stopped watching[/]: every worker was stopped")


def wait_for_change(directory: Path, seen: frozenset[tuple[str, int, int]]) -> None:
    """Return once the submission's files differ from ``seen`` and have settled."""
    now = fingerprint(directory)
    while now == seen:
        time.sleep(POLL_SECONDS)
        now = fingerprint(directory)
    while True:
        time.sleep(SETTLE_SECONDS)
        later = fingerprint(directory)
        if later == now:
            return
        now = later
