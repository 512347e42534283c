"""Pipeline schedules drawn as timelines: rows are ranks, columns time steps, cells ``F3``/``B1``.

A schedule test records the order in which every rank ran its forward and
backward work, and the order the schedule prescribes
(:class:`grader.judge.verdict.Schedule`). Seeing the two side by
side is how a student understands what their 1F1B did instead. The PNG
also draws each stage on the broker's clock (``stage_timing`` in the test's
details, :mod:`grader.testkit.timing`): forwards, backwards and the waits
between them, where the pipeline bubble shows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text

from grader.judge.verdict import Cell, Timeline, Verdict

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from grader.report.results import GradedResult


def timelines_of(verdict: Verdict) -> tuple[Timeline, Timeline] | None:
    """The (actual, expected) timelines a test recorded, or None if it recorded none."""
    if verdict.schedule is None:
        return None
    return verdict.schedule.actual, verdict.schedule.expected


def _style(cell: Cell, right: bool) -> str:
    if not right:
        return "bold white on red"
    return "white on blue" if cell.forward else "black on green"


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


COLORS = {"forward": "#1f77b4", "backward": "#2ca02c", "forward+backward": "#17becf"}
OTHER_COLOR, IDLE_COLOR, WRONG_COLOR = "#9e9e9e", "#f2f2f2", "#d62728"
Timing = list[list[dict]]  # per rank, the segments of grader.testkit.timing.stage_timing


def _legend(axis: Axes, entries: dict[str, str]) -> None:
    import matplotlib.patches as mpatches

    handles = [
        mpatches.Patch(facecolor=c, edgecolor="#666666", label=n) for n, c in entries.items()
    ]
    axis.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False
    )


def _draw_timing(axis: Axes, timing: Timing) -> None:
    """Each stage's forwards, backwards and waits on the broker's clock, in milliseconds."""
    import matplotlib.pyplot as plt

    end = max((seg["end"] for row in timing for seg in row), default=0.0)
    for rank, segments in enumerate(timing):
        for seg in segments:
            start, width = 1e3 * seg["start"], 1e3 * (seg["end"] - seg["start"])
            idle = seg["kind"] == "idle"
            color = IDLE_COLOR if idle else COLORS.get(seg["kind"], OTHER_COLOR)
            axis.add_patch(
                plt.Rectangle((start, rank - 0.4), width, 0.8, facecolor=color, linewidth=0)
            )
            if seg["label"] and width >= 1e3 * end / 40:  # a label that fits its box
                axis.text(
                    start + width / 2,
                    rank,
                    seg["label"],
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                    clip_on=True,
                )
    axis.set_xlim(0, 1e3 * end * 1.01 or 1)
    axis.set_xlabel("time since the step began (ms, the broker's clock)")
    _legend(
        axis, {**COLORS, "other (messages, bookkeeping)": OTHER_COLOR, "waiting (idle)": IDLE_COLOR}
    )


def _draw_order(axis: Axes, rows: Timeline, expected: Timeline, judged: bool) -> None:
    """One slot per forward or backward, in each rank's order; red where it differs."""
    import matplotlib.pyplot as plt

    for rank, row in enumerate(rows):
        for step, cell in enumerate(row):
            wrong = judged and (step >= len(expected[rank]) or cell != expected[rank][step])
            kind = "forward" if cell.forward else "backward"
            color = WRONG_COLOR if wrong else COLORS[kind]
            axis.add_patch(plt.Rectangle((step, rank - 0.4), 0.95, 0.8, color=color))
            axis.text(
                step + 0.47, rank, str(cell), ha="center", va="center", color="white", fontsize=8
            )
    steps = max(len(row) for row in rows + expected)
    axis.set_xlim(0, steps)
    axis.set_xlabel("step (the order of work on each rank)")
    entries = {"forward": COLORS["forward"], "backward": COLORS["backward"]}
    _legend(axis, {**entries, "not the expected step": WRONG_COLOR} if judged else entries)


def write_png(
    actual: Timeline, expected: Timeline, path: Path, title: str, timing: Timing | None = None
) -> Path:
    """The stages on the broker's clock (when timed), then the order of work of each rank
    beside the expected order, each panel with its legend; saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = max(len(row) for row in actual + expected)
    ranks = len(expected)
    panels: list[tuple[str, Callable[[Axes], None]]] = []
    if timing and any(timing):
        panels.append(("your schedule in time", lambda axis: _draw_timing(axis, timing)))
    panels.append(
        ("your order of work", lambda axis: _draw_order(axis, actual, expected, judged=True))
    )
    panels.append(("expected", lambda axis: _draw_order(axis, expected, expected, judged=False)))
    figure, axes = plt.subplots(
        len(panels),
        1,
        figsize=(max(8.0, 0.55 * steps + 3.5), 0.6 + 1.3 * ranks * len(panels)),
        squeeze=False,
    )
    for axis, (label, draw) in zip(axes[:, 0], panels, strict=True):
        draw(axis)
        axis.set_ylim(ranks - 0.5, -0.5)
        axis.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
        axis.set_title(label, loc="left", fontsize=10)
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def png_path(result: GradedResult, directory: Path) -> Path:
    test = result.test
    name = "".join(c if c.isalnum() or c in "-_" else "_" for c in test.name)
    return directory / f"schedule-{test.part}-{name}-ws{test.world_size}.png"


def draw_failed_schedules(results: list[GradedResult], directory: Path) -> list[GradedResult]:
    """A PNG beside results.json for every failed test that recorded a schedule; the PNG of
    a schedule that now passes is removed (it would show a mistake already fixed).

    The picture's name is added to the test's message, so the student finds it.
    """
    drawn_results = []
    for result in results:
        drawn = timelines_of(result.verdict)
        path = png_path(result, directory)
        if drawn is not None and result.verdict.passed:
            path.unlink(missing_ok=True)
        if result.verdict.passed or drawn is None:
            drawn_results.append(result)
            continue
        timing = result.verdict.details.get("stage_timing")
        write_png(*drawn, path, title=result.test.title, timing=timing)
        message = result.verdict.message + f" (schedules drawn in {path.name})"
        verdict = replace(result.verdict, message=message)
        drawn_results.append(replace(result, verdict=verdict, picture=path))
    return drawn_results
