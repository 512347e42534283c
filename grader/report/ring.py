"""Ring attention's forward drawn as a grid: rows are ranks, columns the ring's steps.

A cell says whose K/V block the rank held at that step, as the broker carried it
(:class:`grader.judge.verdict.RingCell`), and what the rank does with it: the whole block,
the diagonal one under the causal triangle, or none (skipped, in causal attention, because
every key is in the future; the block is still passed on). A block that is not the one the
ring hands the rank at that step is red. The grid is read from the broker's record, so it
shows what moved, not what the rank says it did.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Group
from rich.table import Table
from rich.text import Text

from grader.judge.verdict import Ring, RingCell, Work

if TYPE_CHECKING:
    from grader.report.results import GradedResult

WRONG = "#d62728"
COLORS = {Work.WHOLE: "#1f77b4", Work.DIAGONAL: "#2ca02c", Work.SKIPPED: "#b0b0b0"}
STYLES = {Work.WHOLE: "white on blue", Work.DIAGONAL: "black on green", Work.SKIPPED: "dim"}
LEGEND = (
    "KVj = the K/V block of rank j that the broker carried to this rank; what the rule does "
    "with it: the whole block, tri = the causal triangle only, skip = its keys are all in the "
    "future: not computed, passed on; red = not the block the ring hands this rank now"
)


def _label(cell: RingCell) -> str:
    return cell.text if cell.right else f"{cell.text} (want KV{cell.expected})"


def terminal_table(ring: Ring, title: str) -> Group:
    """The ring's steps, one row per rank, and the legend below."""
    steps = max(len(row) for row in ring.cells)
    table = Table(title=title, title_justify="left", box=None)
    table.add_column("", no_wrap=True)
    for step in range(steps):
        table.add_column(f"step {step}", justify="center", min_width=8)
    for rank, row in enumerate(ring.cells):
        cells = [
            Text(f" {_label(c)} ", style=STYLES[c.work] if c.right else "bold white on red")
            for c in row
        ]
        table.add_row(f"rank {rank} ", *cells)
    return Group(table, Text(f"  {LEGEND}", style="dim"))


def write_png(ring: Ring, path: Path, title: str) -> Path:
    """Draw the grid and save it to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks, steps = len(ring.cells), max(len(row) for row in ring.cells)
    figure, axis = plt.subplots(figsize=(max(7.0, 1.6 * steps + 2.0), 1.8 + 0.7 * ranks))
    for rank, row in enumerate(ring.cells):
        for step, cell in enumerate(row):
            color = COLORS[cell.work] if cell.right else WRONG
            axis.add_patch(plt.Rectangle((step, rank - 0.4), 0.95, 0.8, color=color))
            text = cell.text if cell.right else f"{cell.text}\n(want KV{cell.expected})"
            axis.text(step + 0.47, rank, text, ha="center", va="center", fontsize=8)
    axis.set_xlim(0, steps)
    axis.set_ylim(ranks - 0.5, -0.5)
    axis.set_xticks([s + 0.47 for s in range(steps)], [f"step {s}" for s in range(steps)])
    axis.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[w]) for w in Work]
    names = ["whole block", "diagonal (causal triangle)", "skipped (future keys)"]
    axis.legend(
        [*handles, plt.Rectangle((0, 0), 1, 1, color=WRONG)],
        [*names, "wrong block"],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12),
        ncol=2,
        fontsize=7,
        frameon=False,
    )
    kind = "causal" if ring.causal else "not causal"
    axis.set_title(
        f"{title}\nring attention's forward ({kind}): whose K/V block each rank holds",
        fontsize=9,
        loc="left",
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path


def draw_failed_rings(results: list[GradedResult], directory: Path) -> list[GradedResult]:
    """A PNG beside results.json for every failed test that recorded the ring's steps.

    The picture's name is added to the test's message, so the student finds it.
    """
    drawn = []
    for result in results:
        ring = result.verdict.ring
        if result.verdict.passed or ring is None:
            drawn.append(result)
            continue
        test = result.test
        name = "".join(c if c.isalnum() or c in "-_" else "_" for c in test.name)
        path = directory / f"ring-{test.part}-{name}-ws{test.world_size}.png"
        write_png(ring, path, title=test.title)
        message = result.verdict.message + f" (the ring's steps drawn in {path.name})"
        drawn.append(
            replace(result, verdict=replace(result.verdict, message=message), picture=path)
        )
    return drawn
