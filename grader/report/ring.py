"""Ring attention drawn as a grid: rows are ranks (forward, then backward), columns the steps.

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
from typing import TYPE_CHECKING, Any

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
    "future: not computed, passed on; red = not the block the ring hands this rank now; "
    "dK/dV sent on: the dK/dV blocks the rank passed on in backward, p with the hop home"
)


def _label(cell: RingCell) -> str:
    return cell.text if cell.right else f"{cell.text} (want KV{cell.expected})"


def _rows(ring: Ring) -> list[tuple[str, list[RingCell], str | None]]:
    """(label, cells, the dK/dV hops text or None) of each row: forward, then backward."""
    p = len(ring.cells)
    rows: list[tuple[str, list[RingCell], str | None]] = [
        (f"rank {r} forward" if ring.backward else f"rank {r}", row, None)
        for r, row in enumerate(ring.cells)
    ]
    for r, row in enumerate(ring.backward):
        hops = ring.homeward[r] if r < len(ring.homeward) else 0
        rows.append((f"rank {r} backward", row, f"{hops} of {p}"))
    return rows


def terminal_table(ring: Ring, title: str) -> Group:
    """The ring's steps, one row per rank and pass, and the legend below."""
    steps = max(len(row) for row in ring.cells)
    table = Table(title=title, title_justify="left", box=None)
    table.add_column("", no_wrap=True)
    for step in range(steps):
        table.add_column(f"step {step}", justify="center", min_width=8)
    if ring.backward:
        table.add_column("dK/dV sent on", justify="center")
    p = len(ring.cells)
    for label, row, hops in _rows(ring):
        cells = [
            Text(f" {_label(c)} ", style=STYLES[c.work] if c.right else "bold white on red")
            for c in row
        ]
        if ring.backward:
            short = hops is not None and int(hops.split()[0]) < p
            cells.append(Text(f" {hops or ''} ", style="bold white on red" if short else ""))
        table.add_row(f"{label} ", *cells)
    return Group(table, Text(f"  {LEGEND}", style="dim"))


def write_png(ring: Ring, path: Path, title: str) -> Path:
    """Draw the grid and save it to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, steps, p = _rows(ring), max(len(row) for row in ring.cells), len(ring.cells)
    columns = steps + bool(ring.backward)
    figure, axis = plt.subplots(figsize=(max(7.0, 1.6 * columns + 2.5), 1.8 + 0.7 * len(rows)))
    for y, (_, row, hops) in enumerate(rows):
        for step, cell in enumerate(row):
            color = COLORS[cell.work] if cell.right else WRONG
            axis.add_patch(plt.Rectangle((step, y - 0.4), 0.95, 0.8, color=color))
            text = cell.text if cell.right else f"{cell.text}\n(want KV{cell.expected})"
            axis.text(step + 0.47, y, text, ha="center", va="center", fontsize=8)
        if hops is not None:
            short = int(hops.split()[0]) < p
            axis.add_patch(
                plt.Rectangle((steps, y - 0.4), 0.95, 0.8, color=WRONG if short else "#dddddd")
            )
            axis.text(steps + 0.47, y, f"dK/dV\n{hops}", ha="center", va="center", fontsize=8)
    axis.set_xlim(0, columns)
    axis.set_ylim(len(rows) - 0.5, -0.5)
    ticks = [f"step {s}" for s in range(steps)] + ["home"] * bool(ring.backward)
    axis.set_xticks([s + 0.47 for s in range(columns)], ticks)
    axis.set_yticks(range(len(rows)), [label for label, _, _ in rows])
    _legend(axis, plt)
    kind = "causal" if ring.causal else "not causal"
    axis.set_title(
        f"{title}\nring attention ({kind}): whose K/V block each rank holds, as the broker "
        "carried it",
        fontsize=9,
        loc="left",
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path


def _legend(axis: Any, plt: Any) -> None:
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[w]) for w in Work]
    names = ["whole block", "diagonal (causal triangle)", "skipped (future keys)"]
    axis.legend(
        [*handles, plt.Rectangle((0, 0), 1, 1, color=WRONG)],
        [*names, "wrong block, or a dK/dV hop missing"],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12),
        ncol=2,
        fontsize=7,
        frameon=False,
    )


def worth_drawing(ring: Ring | None, drawn: list[Ring]) -> bool:
    """A ring that went wrong and is not one of ``drawn`` (added to it): a picture of a
    right ring, or the same picture again, says nothing about the bug."""
    key = _key(ring) if ring is not None else None
    if ring is None or not ring.wrong or key in (_key(r) for r in drawn):
        return False
    drawn.append(ring)
    return True


def _key(ring: Ring) -> tuple:
    """What the picture shows: the blocks held, forward and backward, and the dK/dV hops."""
    cells = [(c.held, c.expected) for row in (*ring.cells, *ring.backward) for c in row]
    return (tuple(cells), tuple(ring.homeward))


def draw_failed_rings(results: list[GradedResult], directory: Path) -> list[GradedResult]:
    """A PNG beside results.json for each wrong ring that a failed test recorded, once: the
    later tests with the same ring name the same picture.

    The picture's name is added to the test's message, so the student finds it.
    """
    drawn: list[GradedResult] = []
    paths: dict[tuple, Path] = {}
    rings: list[Ring] = []
    for result in results:
        ring = result.verdict.ring
        if result.verdict.passed or ring is None or not ring.wrong:
            drawn.append(result)
            continue
        test = result.test
        if worth_drawing(ring, rings):
            name = "".join(c if c.isalnum() or c in "-_" else "_" for c in test.name)
            path = directory / f"ring-{test.part}-{name}-ws{test.world_size}.png"
            paths[_key(ring)] = write_png(ring, path, title=test.title)
        path = paths[_key(ring)]
        message = result.verdict.message + f" (the ring's steps drawn in {path.name})"
        drawn.append(
            replace(result, verdict=replace(result.verdict, message=message), picture=path)
        )
    return drawn
