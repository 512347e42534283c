"""What a person sees: a progress bar while grading, then a matrix per part and what to fix."""

from __future__ import annotations

from collections import defaultdict

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from grader.course.catalog import GradedTest
from grader.judge.verdict import Verdict
from grader.protocol import NOT_RUN, clean
from grader.report import ring
from grader.report.results import GradedResult, Points
from grader.report.summary import (
    LEGEND,
    OUTCOME_STYLE,
    PARTIAL,
    PARTIAL_STYLE,
    fix_first,
    is_partial,
    part_matrix,
    per_test_table,
)
from grader.report.timeline import terminal_table, timelines_of
from grader.sandbox import Level


def progress_bar(console: Console, label: str) -> Progress:
    """The one progress bar of the grader: label, bar, done of all, time, what runs now."""
    return Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
        transient=True,
    )


class ProgressDisplay:
    """A live progress bar: tests done of all, the test running now, and failures as they come."""

    def __init__(self, console: Console, total: int) -> None:
        self.console = console
        self.progress = progress_bar(console, "grading")
        self.task = self.progress.add_task("", total=total)

    def __enter__(self) -> ProgressDisplay:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def on_start(self, test: GradedTest) -> None:
        self.progress.update(self.task, description=escape(test.title))

    def on_verdict(self, test: GradedTest, verdict: Verdict) -> None:
        self.progress.advance(self.task)
        if not verdict.passed:
            partial = 0 < verdict.share() < 1
            word = PARTIAL if partial else verdict.outcome
            style = PARTIAL_STYLE if partial else OUTCOME_STYLE.get(verdict.outcome, "red")
            self.progress.console.print(
                f"[{style}]{word:>9}[/] {escape(test.title)}", highlight=False
            )


def print_summary(
    console: Console,
    results: list[GradedResult],
    seconds: float,
    sandbox: Level = Level.NONE,
    review: list[str] | None = None,
    verbose: bool = False,
) -> None:
    """Per part: the matrix (and every test with ``verbose``), then what to fix first."""
    by_part: dict[str, list[GradedResult]] = defaultdict(list)
    for result in results:
        by_part[result.test.part].append(result)
    for part, part_results in by_part.items():
        console.print(part_matrix(part, part_results))
        console.print(f"[dim]{LEGEND}[/]", highlight=False)
        if verbose:  # after the matrix, as docs/commands.md says
            console.print(per_test_table(part, part_results))
        _print_fixes(console, part, part_results, verbose)
    if review:
        console.print("[bold]For a TA to look at[/] (no effect on the score):")
        for line in review[:20]:
            console.print(f"  {_shown(line)}", highlight=False)
    console.print(f"[dim]student code isolated by: {escape(sandbox.value)}[/]")
    points = Points.of(results)
    passed = sum(r.verdict.passed for r in results)
    partial = sum(is_partial(r) for r in results)
    some = f", {partial} with partial credit" if partial else ""
    console.print(
        f"[bold]Total: {points} points[/]  "
        f"({passed} of {len(results)} tests passed{some}, {seconds:.1f} s)"
    )


def _print_fixes(console: Console, part: str, results: list[GradedResult], verbose: bool) -> None:
    fixes = fix_first(results, collapse=not verbose)
    if not fixes.shown and not fixes.hidden:
        return
    console.print(f"[bold]What to fix first in {escape(part)}:[/]")
    # A message is one long line: a terminal wraps it, a log keeps it whole.
    wrap = {"soft_wrap": not console.is_terminal, "highlight": False}
    rings: list = []  # the ring pictures shown: each once
    for result in fixes.shown:
        test = result.test
        credit = (
            f", partial: {result.score:g} of {result.max_score:g} points"
            if is_partial(result)
            else ""
        )
        console.print(
            f"  [bold]{escape(test.name)}[/] (world size {test.world_size}{credit}): "
            f"{_shown(result.verdict.message)}",
            **wrap,
        )
        affected = fixes.affected(result)
        if affected:
            console.print(f"    [dim]the same cause failed {escape(affected)}[/]", **wrap)
        drawn = timelines_of(result.verdict)
        if drawn:
            console.print(terminal_table(*drawn, title="  schedule (F = forward, B = backward)"))
        if ring.worth_drawing(result.verdict.ring, rings):
            console.print(ring.terminal_table(result.verdict.ring, title="  the ring's steps"))
    if not fixes.shown and fixes.not_run:  # nothing ran: why not is the first thing to fix
        reason = next(r.verdict.message for r in results if r.verdict.outcome == NOT_RUN)
        console.print(f"  {_shown(reason)}", **wrap)
    if fixes.hidden:
        console.print(f"  [dim]{escape(fixes.summary_line())}[/]", **wrap)
    console.print()


def _shown(text: str) -> str:
    """Text a submission may have chosen (its file names, what its ranks said), for the
    terminal: no control characters (escape codes), no rich markup."""
    return escape(clean(text, len(text)))
