"""Pipeline schedules drawn as timelines: rows are ranks, columns time steps, cells ``F3``/``B1``.

A schedule test records the order in which every rank ran its forward and
backward work, and the order the schedule prescribes
(:class:`grader.judge.verdict.Schedule`). Seeing the two side by
side is how a student understands what their 1F1B did instead.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text

from grader.judge.verdict import Timeline, Verdict

if TYPE_CHECKING:
    from grader.report.results import GradedResult


def timelines_of(verdict: Verdict) -> tuple[Timeline, Timeline] | None:
    """The (actual, expected) timelines a test recorded, or None if it recorded none."""
    if verdict.schedule is None:
        return None
    return verdict.schedule.actual, verdict.schedule.expected


def _style(cell: str, right: bool) -> str:
    if not right:
        return "bold white on red"
    return "white on blue" if cell.startswith("F") else "black on green"


def terminal_table(actual: Timeline, expected: Timeline, title: str) -> Table:
    """Each rank's schedule above the expected one; cells that differ are red."""
    steps = max(len(row) for row in actual + expected)
    table = Table(title=title, title_justify="left", show_header=True, box=None, padding=(0, 0))
    table.add_column("", no_wrap=True)
    for step in range(steps):
        table.add_column(str(step), justify="center", min_width=4)
    for rank, (mine, want) in enumerate(zip(actual, expected, strict=False)):
        cells = [
            Text(f" {c} ", style=_style(c, i < len(want) and c == want[i]))
            for i, c in enumerate(mine)
        ]
        table.add_row(f"rank {rank} yours    ", *cells)
        table.add_row(
            f"rank {rank} expected ",
            *[Text(f" {c} ", style=_style(c, True) + " dim") for c in want],
        )
    return table


def write_png(actual: Timeline, expected: Timeline, path: Path, title: str) -> Path:
    """Draw the two schedules as two Gantt-like panels and save them to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = max(len(row) for row in actual + expected)
    ranks = len(expected)
    figure, axes = plt.subplots(
        2, 1, figsize=(max(6.0, 0.55 * steps + 1.5), 1.2 + 1.1 * ranks), sharex=True
    )
    for axis, rows, label in ((axes[0], actual, "your schedule"), (axes[1], expected, "expected")):
        for rank, row in enumerate(rows):
            for step, cell in enumerate(row):
                wrong = label == "your schedule" and (
                    step >= len(expected[rank]) or cell != expected[rank][step]
                )
                color = "#d62728" if wrong else ("#1f77b4" if cell.startswith("F") else "#2ca02c")
                axis.add_patch(plt.Rectangle((step, rank - 0.4), 0.95, 0.8, color=color))
                axis.text(
                    step + 0.47, rank, cell, ha="center", va="center", color="white", fontsize=8
                )
        axis.set_ylim(ranks - 0.5, -0.5)
        axis.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
        axis.set_title(label, loc="left", fontsize=10)
    axes[1].set_xlim(0, steps)
    axes[1].set_xlabel("step (the order of work on each rank)")
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def draw_failed_schedules(results: list[GradedResult], directory: Path) -> list[GradedResult]:
    """A PNG beside results.json for every failed test that recorded a schedule.

    The picture's name is added to the test's message, so the student finds it.
    """
    drawn_results = []
    for result in results:
        drawn = timelines_of(result.verdict)
        if result.verdict.passed or drawn is None:
            drawn_results.append(result)
            continue
        test = result.test
        name = "".join(c if c.isalnum() or c in "-_" else "_" for c in test.name)
        path = directory / f"schedule-{test.part}-{name}-ws{test.world_size}.png"
        write_png(*drawn, path, title=test.title)
        message = result.verdict.message + f" (schedules drawn in {path.name})"
        drawn_results.append(replace(result, verdict=replace(result.verdict, message=message)))
    return drawn_results
