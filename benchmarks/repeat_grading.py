"""No flakes: grade the same submissions several times and count the cost points they earn.

    python benchmarks/repeat_grading.py [--runs 10]

The reference must earn every performance and communication point on every
run, on this noisy machine; a correct but naive all-reduce (every rank sends
its whole tensor to every other) must lose its communication points at world
sizes 3 and 4 on every run. Prints one line per run and a verdict.
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
    args = parser.parse_args()
    flakes = 0
    for run in range(1, args.runs + 1):
        results, seconds = grade(["collectives", "--submission", "reference"])
        earned, maximum = cost_points(results)
        worst = max((t["extra_data"].get("time_ratio", 0) for t in results["tests"]), default=0)
        flakes += earned != maximum
        print(
            f"reference run {run}: cost points {earned:g} / {maximum:g}, "
            f"worst time ratio {worst:.2f}, {seconds:.0f} s",
            flush=True,
        )
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
        flakes += earned != 0
        print(
            f"naive all-reduce run {run}: communication points {earned:g} / {maximum:g}, "
            f"{seconds:.0f} s",
            flush=True,
        )
    print("no flakes" if flakes == 0 else f"{flakes} flaky runs")
    sys.exit(1 if flakes else 0)


if __name__ == "__main__":
    main()
