"""No flakes: grade the same submissions several times; every run must give the same scores.

    python benchmarks/repeat_grading.py [--runs 10] [--parts collectives ...]

The reference must earn every point on every run, test by test identical,
on this noisy machine (cost points are judged from message patterns, not
clocks); a correct but naive all-reduce (every rank sends its whole tensor
to every other) must lose the same communication and performance points at
world sizes 3 and 4 on every run. Prints one line per run and a verdict.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--parts", nargs="*", default=[], help="default: every part")
    args = parser.parse_args()
    flakes = 0
    first: dict[str, float] | None = None
    for run in range(1, args.runs + 1):
        results, seconds = grade([*args.parts, "--submission", "reference"])
        scores = {t["name"]: t["score"] for t in results["tests"]}
        maximum = sum(t["max_score"] for t in results["tests"])
        first = first or scores
        flakes += scores != first or results["score"] != maximum
        earned, cost_maximum = cost_points(results)
        print(
            f"reference run {run}: {results['score']:g} / {maximum:g} points "
            f"(cost points {earned:g} / {cost_maximum:g}), "
            f"{'identical to run 1' if scores == first else 'DIFFERS from run 1'}, {seconds:.0f} s",
            flush=True,
        )
    naive: dict[str, float] | None = None
    for run in range(1, args.runs + 1):
        results, seconds = grade(
            [
                "collectives",
                "--submission",
                str(NAIVE),
                "-k",
                "all_reduce",
                "--world-size",
                "3",
                "--world-size",
                "4",
            ]
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
    print("no flakes" if flakes == 0 else f"{flakes} flaky runs")
    sys.exit(1 if flakes else 0)


if __name__ == "__main__":
    main()
