"""``grader bench``'s report from made-up measurements: fast, no job.

The PNG must be legible (at least 1000 px wide, the legend beside the panels, not
over a line), and equal projections must say what the projections leave out.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from grader.bench.runner import BenchResult, plot, print_tables, projection_caption
from grader.testkit.calls import COLLECTIVES

SIZES = [4096 * 4**k for k in range(5)]


def records(functions: list[str], world_size: int) -> list[dict]:
    made = []
    for function in functions:
        for impl, speed in (("student", 1e9), ("reference", 2e9), ("torch", 3e9)):
            for nbytes in SIZES:
                seconds = 1e-5 + nbytes / speed / world_size
                made.append(
                    {"function": function, "impl": impl, "bytes": nbytes, "seconds": seconds}
                )
    return made


@pytest.mark.parametrize(
    "functions",
    [
        ["all_reduce"],
        list(COLLECTIVES),
    ],
)
def test_plot_is_wide_with_the_legend_outside_the_panels(functions: list[str], tmp_path: Path):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [BenchResult(p, records(functions, p)) for p in (2, 4)]
    figures: list = []
    original = plt.close
    plt.close = lambda figure=None: figures.append(figure)  # keep it to inspect
    try:
        path = plot(results, tmp_path / "bench.png")
    finally:
        plt.close = original
    width, _ = plt.imread(path).shape[1::-1]
    assert width >= 1000
    figure = figures[0]
    renderer = figure.canvas.get_renderer()
    legend = figure.legends[0].get_window_extent(renderer)
    assert len(figure.legends[0].get_texts()) == 6  # 3 implementations x 2 world sizes
    for axis in figure.axes:
        if axis.get_visible():
            assert not legend.overlaps(axis.get_window_extent(renderer))
    plt.close(figure)


def test_equal_projections_say_they_model_the_message_pattern_only() -> None:
    same = {"nvlink": 1e-3, "infiniband": 2e-3}
    rows = {SIZES[-1]: {"student": {"projected": same}, "reference": {"projected": dict(same)}}}
    caption = projection_caption(rows)
    assert "yours 1.00 ms, reference 1.00 ms" in caption
    assert "they model the message pattern only" in caption
    rows[SIZES[-1]]["student"]["projected"] = {"nvlink": 2e-3, "infiniband": 4e-3}
    assert "message pattern only" not in projection_caption(rows)
    assert projection_caption({}) == ""


def stubbed(function: str, world_size: int) -> list[dict]:
    """The worker's records when the student's ``function`` raises NotImplementedError."""
    made = [r for r in records([function], world_size) if r["impl"] != "student"]
    error = f"NotImplementedError: {function}"
    return [{"function": function, "impl": "student", "bytes": SIZES[0], "error": error}, *made]


def test_a_stubbed_function_is_not_implemented_yet_in_the_table_and_the_plot(tmp_path: Path):
    results = [BenchResult(2, stubbed("all_reduce", 2))]
    out = io.StringIO()
    print_tables(Console(file=out, width=250, color_system=None), results)
    text = out.getvalue()
    assert "error" not in text.replace("NotImplementedError", "")
    rows = [line for line in text.splitlines() if " KB │" in line or " MB │" in line]
    assert len(rows) == len(SIZES) and all("not implemented yet" in row for row in rows)
    assert "student: not implemented yet (NotImplementedError: all_reduce)" in text
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures: list = []
    original = plt.close
    plt.close = lambda figure=None: figures.append(figure)
    try:
        plot(results, tmp_path / "bench.png")
    finally:
        plt.close = original
    texts = [t.get_text() for t in figures[0].axes[0].texts]
    assert "student: not implemented yet" in texts  # why its line is missing
    plt.close(figures[0])
