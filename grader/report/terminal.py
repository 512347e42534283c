"""What a person sees: a progress bar while grading, then a table per part and what to fix first."""

from __future__ import annotations

from collections import defaultdict

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from grader import protocol
from grader.catalog import GradedTest
from grader.judge.verdict import Verdict
from grader.report.results import GradedResult
from grader.report.timeline import terminal_table, timelines_of

OUTCOME_STYLE = {
    protocol.PASSED: "green",
    protocol.FAILED: "red",
    protocol.ERROR: "red",
    protocol.TIMEOUT: "magenta",
    protocol.CRASHED: "red bold",
    protocol.FORBIDDEN: "yellow",
    protocol.NOT_RUN: "dim",
}


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
            style = OUTCOME_STYLE.get(verdict.outcome, "red")
            self.progress.console.print(
                f"[{style}]{verdict.outcome:>9}[/] {escape(test.title)}", highlight=False
            )


def print_summary(console: Console, results: list[GradedResult], seconds: float) -> None:
    by_part: dict[str, list[GradedResult]] = defaultdict(list)
    for result in results:
        by_part[result.test.part].append(result)
    for part, part_results in by_part.items():
        console.print(_part_table(part, part_results))
        failures = [r for r in part_results if not r.verdict.passed]
        if failures:
            console.print(f"[bold]What to fix first in {escape(part)}:[/]")
            for result in _first_per_target(failures):
                console.print(
                    f"  [bold]{escape(result.test.name)}[/] (world size {result.test.world_size}): "
                    f"{escape(result.verdict.message)}",
                    highlight=False,
                )
                drawn = timelines_of(result.verdict.extra)
                if drawn:
                    console.print(
                        terminal_table(*drawn, title="  schedule (F = forward, B = backward)")
                    )
            console.print()
    total = sum(r.score for r in results)
    maximum = sum(r.max_score for r in results)
    passed = sum(r.verdict.passed for r in results)
    console.print(
        f"[bold]Total: {total:g} / {maximum:g} points[/]  "
        f"({passed} of {len(results)} tests passed, {seconds:.1f} s)"
    )


def _part_table(part: str, results: list[GradedResult]) -> Table:
    table = Table(title=Text(part, style="bold"), title_justify="left", show_lines=False)
    table.add_column("test")
    table.add_column("target")
    table.add_column("world size", justify="right")
    table.add_column("outcome")
    table.add_column("points", justify="right")
    for result in results:
        style = OUTCOME_STYLE.get(result.verdict.outcome, "")
        table.add_row(
            Text(result.test.name),
            Text(result.test.target),
            str(result.test.world_size),
            f"[{style}]{result.verdict.outcome}[/]",
            f"{result.score:g} / {result.max_score:g}",
        )
    score = sum(r.score for r in results)
    maximum = sum(r.max_score for r in results)
    table.add_section()
    table.add_row("[bold]total", "", "", "", f"[bold]{score:g} / {maximum:g}")
    return table


def _first_per_target(failures: list[GradedResult]) -> list[GradedResult]:
    """One failure per test (each parametrization is its own), at its smallest world size:
    the simplest case to debug."""
    first: dict[str, GradedResult] = {}
    for result in sorted(failures, key=lambda r: r.test.world_size):
        first.setdefault(result.test.name, result)
    return list(first.values())
