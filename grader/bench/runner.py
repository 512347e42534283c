"""``grader bench``: a sweep of message sizes and world sizes, shown as nccl-tests would.

For each world size one torchrun job measures every collective at every
size for three implementations: the student's, the reference's and
torch.distributed's own. The results are a table per collective (time, and
bus bandwidth with nccl-tests' factors), a PNG of bus bandwidth against
message size, and the alpha-beta projection of the student's and the
reference's message patterns on real machines.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

from grader.bench import records
from grader.course.submission import stage
from grader.judge.communication import BUS_FACTOR
from grader.launch.job import TorchrunJob
from grader.report.terminal import progress_bar
from grader.report.units import duration, size

IMPLEMENTATIONS = ("student", "reference", "torch")
DEFAULT_SIZES = tuple(4**k * 1024 for k in range(1, 9))  # 4 KiB ... 64 MiB
_STALL_SECONDS = 120.0


@dataclass
class BenchResult:
    world_size: int
    records: list[dict[str, Any]] = field(default_factory=list)
    problem: str = ""


def run_bench(
    console: Console,
    submission: Path,
    functions: list[str],
    world_sizes: list[int],
    sizes: list[int],
    iterations: int,
) -> list[BenchResult]:
    results = []
    total = len(world_sizes) * len(functions) * len(sizes) * len(IMPLEMENTATIONS)
    progress = progress_bar(console, "bench")
    with tempfile.TemporaryDirectory(prefix="grader-bench-") as work, progress:
        task = progress.add_task("", total=total)
        import_dir = Path(work).resolve() / "import"
        stage(submission, import_dir)
        for world_size in world_sizes:
            job_dir = Path(work) / f"ws{world_size}"
            job_dir.mkdir()
            plan = {
                "import_dir": str(import_dir),
                "functions": functions,
                "sizes": sizes,
                "iterations": iterations,
                "op_timeout": 30,
            }
            (job_dir / "bench.json").write_text(json.dumps(plan))
            results.append(_run_job(job_dir, world_size, progress, task))
    return results


def _run_job(job_dir: Path, world_size: int, progress: Progress, task: Any) -> BenchResult:
    result = BenchResult(world_size)
    reader = records.ReportReader(records.report_path(job_dir, 0))
    last_progress = time.monotonic()
    with TorchrunJob(job_dir, world_size, module="grader.bench.worker") as job:
        while True:
            for record in reader.new_records():
                if record["event"] == "measured":
                    result.records.append(record)
                    progress.advance(task)
                    progress.update(
                        task,
                        description=f"{record['function']} {size(record['bytes'])} ws={world_size}",
                    )
                    last_progress = time.monotonic()
                elif record["event"] == "student_error":
                    result.problem = f"the submission could not be imported: {record['message']}"
                elif record["event"] == "finished":
                    return result
            if not job.running():
                result.problem = result.problem or "the job ended early: " + job.log_tail(2)
                return result
            if time.monotonic() - last_progress > _STALL_SECONDS:
                result.problem = f"no progress for {_STALL_SECONDS:.0f} s: stopped"
                return result
            time.sleep(0.1)


def busbw(record: dict[str, Any], world_size: int) -> float:
    """nccl-tests' bus bandwidth, GB/s: bytes / time * the collective's factor."""
    factor = BUS_FACTOR[record["function"]](world_size)
    return record["bytes"] / record["seconds"] / 1e9 * factor


def print_tables(console: Console, results: list[BenchResult]) -> None:
    for result in results:
        if result.problem:
            console.print(f"[red]world size {result.world_size}: {escape(result.problem)}[/]")
        functions = dict.fromkeys(r["function"] for r in result.records)
        for function in functions:
            table = Table(
                title=f"[bold]{function}[/], {result.world_size} ranks", title_justify="left"
            )
            table.add_column("size", justify="right")
            for impl in IMPLEMENTATIONS:
                table.add_column(f"{impl} time", justify="right")
                table.add_column(f"{impl} busbw GB/s", justify="right")
            rows: dict[int, dict[str, dict[str, Any]]] = {}
            for record in result.records:
                if record["function"] == function:
                    rows.setdefault(record["bytes"], {})[record["impl"]] = record
            failed = failures(result.records, function)
            for nbytes, by_impl in sorted(rows.items()):
                cells = []
                for impl in IMPLEMENTATIONS:
                    record = by_impl.get(impl)
                    if record is None or "seconds" not in record:
                        word = failed[impl][0] if impl in failed else "-"
                        cells += [f"[red]{word}[/]" if record else word, ""]
                    else:
                        cells += [
                            duration(record["seconds"]),
                            f"{busbw(record, result.world_size):.3f}",
                        ]
                table.add_row(size(nbytes), *cells)
            reasons = [f"{impl}: {word} ({why})" for impl, (word, why) in failed.items()]
            caption = "; ".join(filter(None, [projection_caption(rows), *reasons]))
            if caption:
                table.caption = caption
            console.print(table)


def failures(records: list[dict[str, Any]], function: str) -> dict[str, tuple[str, str]]:
    """Each implementation that raised on ``function``: a word for its cells, and why.

    A stub raises NotImplementedError: that is "not implemented yet", as `grader run` says,
    not an error; the worker measures no larger size of an implementation that raised.
    """
    failed = {}
    for record in records:
        if record["function"] == function and "error" in record:
            error = str(record["error"])
            word = "not implemented yet" if error.startswith("NotImplementedError") else "error"
            failed.setdefault(record["impl"], (word, error))
    return failed


def projection_caption(rows: dict[int, dict[str, dict[str, Any]]]) -> str:
    """The student's and the reference's message patterns projected on each machine, at the
    largest size; when they project equal, why the measured times may still differ."""
    if not rows:
        return ""
    largest = rows[max(rows)]
    student, reference = largest.get("student", {}), largest.get("reference", {})
    if "projected" not in student or not reference.get("projected"):
        return ""
    pairs = {
        machine: (student["projected"][machine], seconds)
        for machine, seconds in reference["projected"].items()
        if machine in student["projected"]
    }
    text = f"projected at {size(max(rows))}: " + "; ".join(
        f"{machine}: yours {duration(mine)}, reference {duration(theirs)}"
        for machine, (mine, theirs) in pairs.items()
    )
    if any(math.isclose(mine, theirs, rel_tol=1e-6) for mine, theirs in pairs.values()):
        text += (
            ". Equal projections: they model the message pattern only (sizes, order, "
            "dependencies), not local copies and arithmetic, which the measured times include"
        )
    return text


def binary_size(nbytes: float) -> str:
    """4096 -> "4K", 2**26 -> "64M": the sizes swept are powers of two, so are the labels."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return f"{nbytes:g}"


PLOT_WIDTH_PX = 1200  # legible on a laptop screen and in a slide, whatever the panel count
PLOT_DPI = 100


def _all(results: list[BenchResult]) -> list[dict[str, Any]]:
    return [record for result in results for record in result.records]


def plot(results: list[BenchResult], path: Path) -> Path:
    """Bus bandwidth against message size: one panel per collective, one line per implementation
    and world size, the legend to the right of the panels (never over a line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    functions = list(dict.fromkeys(r["function"] for res in results for r in res.records))
    columns = min(3, max(1, len(functions)))
    rows = -(-len(functions) // columns)
    width = max(PLOT_WIDTH_PX / PLOT_DPI, 4.2 * columns + 2.5)  # inches: panels + legend
    figure, axes = plt.subplots(
        rows, columns, figsize=(width, 4.2 * rows), squeeze=False, dpi=PLOT_DPI
    )
    legend: dict[str, Any] = {}
    for axis, function in zip(axes.flat, functions, strict=False):
        for label, line in _panel(axis, function, results).items():
            legend.setdefault(label, line)
    for axis in list(axes.flat)[len(functions) :]:
        axis.set_visible(False)
    legend_share = 2.3 / width  # of the figure's width, on the right
    figure.legend(
        list(legend.values()),
        list(legend),
        loc="center left",
        bbox_to_anchor=(1 - legend_share + 0.01, 0.5),
        fontsize=10,
        frameon=False,
    )
    figure.suptitle("bus bandwidth (nccl-tests' busbw) by message size", fontsize=14)
    figure.tight_layout(rect=(0, 0, 1 - legend_share, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=PLOT_DPI)
    plt.close(figure)
    return path


_COLORS = {"student": "tab:blue", "reference": "tab:orange", "torch": "tab:green"}
_LINES = ("-", "--", ":", "-.")  # one line style per world size


def _panel(axis: Any, function: str, results: list[BenchResult]) -> dict[str, Any]:
    """One collective's panel: a line per implementation and world size, and why a line is
    missing; its lines, by label, for the figure's legend."""
    from matplotlib.ticker import FuncFormatter

    drawn: dict[str, Any] = {}
    for index, result in enumerate(results):
        for impl in IMPLEMENTATIONS:
            points = sorted(
                (r["bytes"], busbw(r, result.world_size))
                for r in result.records
                if r["function"] == function and r["impl"] == impl and "seconds" in r
            )
            if points:
                xs, ys = zip(*points, strict=True)
                label = f"{impl}, {result.world_size} ranks"
                (line,) = axis.plot(
                    xs, ys, linestyle=_LINES[index % len(_LINES)], marker="o", markersize=4,
                    linewidth=1.8, color=_COLORS[impl], label=label,
                )  # fmt: skip
                drawn.setdefault(label, line)
    missing = [f"{impl}: {word}" for impl, (word, _) in failures(_all(results), function).items()]
    if missing:  # a line left out says why
        axis.text(0.02, 0.02, "\n".join(missing), transform=axis.transAxes, fontsize=10)
    axis.set_xscale("log", base=2)
    measured = sorted({x for line in axis.get_lines() for x in line.get_xdata()})
    step = max(1, -(-len(measured) // 8))  # at most 8 labels: they never overlap
    axis.set_xticks(measured[::step])
    axis.xaxis.set_major_formatter(FuncFormatter(lambda x, _: binary_size(x)))
    axis.xaxis.set_minor_formatter(FuncFormatter(lambda x, _: ""))
    axis.set_title(function, fontsize=13)
    axis.set_xlabel("message size (bytes)", fontsize=11)
    axis.set_ylabel("bus bandwidth (GB/s)", fontsize=11)
    axis.tick_params(labelsize=9)
    axis.grid(alpha=0.3)
    return drawn
