"""No flakes: grade the same submissions several times; every run must give the same scores.

    python benchmarks/repeat_grading.py [--runs 10] [--hog-runs 3] [--parts collectives ...]
                                        [-k performance]

The reference must earn every point on every run, test by test identical,
``--runs`` times on this machine as it is and ``--hog-runs`` times beside two
CPU hogs (busy loops this benchmark starts and stops): message patterns are
no clock's, and local work is timed in CPU time against the reference's own,
timed in the same run. For every performance test it prints how far the
local work's ratio to the reference's (``local_ratio``) moved between runs.
Then a correct but naive all-reduce (every rank sends its whole tensor to
every other) must lose the same communication points at world sizes 3 and 4
on every run. Prints one line per run and a verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAIVE = REPO / "tests" / "selftests" / "submissions" / "coll_unusual"


def grade(args: list[str]) -> tuple[dict, float]:
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "results.json"
        start = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "grader", "run", *args, "--results", str(results)],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        )
        return json.loads(results.read_text()), time.monotonic() - start


def cost_points(results: dict, name_contains: str = "") -> tuple[float, float]:
    tests = [
        t
        for t in results["tests"]
        if t["extra_data"]["kind"] in ("performance", "communication")
        and name_contains in t["name"]
    ]
    return sum(t["score"] for t in tests), sum(t["max_score"] for t in tests)


@contextlib.contextmanager
def cpu_hogs(count: int) -> Iterator[None]:
    """``count`` busy loops, one process each, for as long as the block runs."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def local_ratios(results: dict) -> dict[str, float]:
    return {
        t["name"]: t["extra_data"]["local_ratio"]
        for t in results["tests"]
        if t["extra_data"].get("local_ratio") is not None
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--hog-runs", type=int, default=3, help="runs beside two CPU hogs")
    parser.add_argument("--parts", nargs="*", default=[], help="default: every part")
    parser.add_argument("-k", dest="keyword", help="passed to grader run")
    args = parser.parse_args()
    selection = [*args.parts, "--submission", "reference"]
    selection += ["-k", args.keyword] if args.keyword else []
    flakes = reference_runs(selection, args.runs, args.hog_runs) + naive_runs(args.runs)
    print("no flakes" if flakes == 0 else f"{flakes} flaky runs")
    sys.exit(1 if flakes else 0)


def reference_runs(selection: list[str], runs: int, hog_runs: int) -> int:
    """Grade the reference ``runs`` times, then ``hog_runs`` beside two CPU hogs; the flaky
    runs (a score that differs from the first run's, or not every point)."""
    flakes = 0
    first: dict[str, float] | None = None
    ratios: dict[str, list[float]] = {}
    for run in range(1, runs + hog_runs + 1):
        beside = run > runs
        with cpu_hogs(2 if beside else 0):
            results, seconds = grade(selection)
        scores = {t["name"]: t["score"] for t in results["tests"]}
        maximum = sum(t["max_score"] for t in results["tests"])
        first = first or scores
        flakes += scores != first or results["score"] != maximum
        earned, cost_maximum = cost_points(results)
        for name, ratio in local_ratios(results).items():
            ratios.setdefault(name, []).append(ratio)
        print(
            f"reference run {run}{' beside 2 CPU hogs' if beside else ''}: "
            f"{results['score']:g} / {maximum:g} points "
            f"(cost points {earned:g} / {cost_maximum:g}), "
            f"{'identical to run 1' if scores == first else 'DIFFERS from run 1'}, {seconds:.0f} s",
            flush=True,
        )
    if ratios:
        spread = {name: max(r) / min(r) - 1 for name, r in ratios.items()}
        worst = max(spread, key=spread.__getitem__)
        every = [r for rs in ratios.values() for r in rs]
        print(
            f"local work over the reference's, {len(ratios)} performance tests: "
            f"{min(every):.3f} to {max(every):.3f} over all runs; between runs a test's moved by "
            f"at most {spread[worst]:.1%} ({worst}), by {statistics.median(spread.values()):.1%} "
            "at the median",
            flush=True,
        )
    return flakes


def naive_runs(runs: int) -> int:
    """Grade the naive all-reduce ``runs`` times; the flaky runs (any communication point, or
    a score that differs from the first run's)."""
    flakes = 0
    naive: dict[str, float] | None = None
    for run in range(1, runs + 1):
        sizes = ["--world-size", "3", "--world-size", "4"]
        results, seconds = grade(
            ["collectives", "--submission", str(NAIVE), "-k", "all_reduce", *sizes]
        )
        earned, maximum = cost_points(results, "communication[all_reduce]")
        scores = {t["name"]: t["score"] for t in results["tests"]}
        naive = naive or scores
        flakes += earned != 0 or scores != naive
        print(
            f"naive all-reduce run {run}: communication points {earned:g} / {maximum:g}, "
            f"every score {'identical to run 1' if scores == naive else 'DIFFERS'}, "
            f"{seconds:.0f} s",
            flush=True,
        )
    return flakes


if __name__ == "__main__":
    main()
