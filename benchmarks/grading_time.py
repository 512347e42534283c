"""How long grading takes, against the cheapest real distributed job, measured side by side.

    python benchmarks/grading_time.py [--repeats 3]

The yardstick is a 4-rank ``torchrun --standalone`` job that only initialises
a gloo process group, passes one barrier and destroys it: the least any
multi-process grading can cost on this machine. Then, each timed as a whole
command, with its peak memory (the largest resident set of any one process):

- the reference, every part (every point expected);
- the untouched stubs, every part (no point expected);
- a submission whose every collective deadlocks, the collectives part.

Prints each wall time and its ratio to the yardstick (medians of --repeats), and
the peak memory of the whole process tree (what a container must allow).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "selftests")]

BARRIER_JOB = """
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""


def timed(command: list[str], cwd: Path) -> tuple[float, float]:
    """Wall seconds of ``command`` and the peak memory of its whole process tree (MB, the sum
    of the resident sets, sampled every 0.1 s: what a container's memory limit must allow)."""
    from grader.launch.job import descendants

    start = time.monotonic()
    process = subprocess.Popen(
        command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    peak = 0
    while process.poll() is None:
        total = 0
        for pid in [process.pid, *descendants(process.pid)]:
            try:
                fields = Path(f"/proc/{pid}/statm").read_text().split()
            except OSError:
                continue
            total += int(fields[1]) * resource.getpagesize()
        peak = max(peak, total)
        time.sleep(0.1)
    return time.monotonic() - start, peak / 2**20


def main() -> None:
    from runner import materialize

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        script = work / "barrier.py"
        script.write_text(BARRIER_JOB)
        deadlocks = materialize("coll_deadlock_all", work)
        grader = [
            sys.executable,
            "-m",
            "grader",
            "--config",
            str(REPO / "tests/graded/grading.yaml"),
        ]
        runs = {
            "torchrun: 4 ranks, init + barrier + destroy": [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=4", f"--log-dir={work / 'logs'}", str(script),
            ],
            "grader run --submission reference (all parts)": [
                *grader, "run", "--submission", str(REPO / "reference"),
                "--results", str(work / "reference.json"),
            ],
            "grader run, the untouched stubs (all parts)": [
                *grader, "run", "--submission", str(REPO / "assignments"),
                "--results", str(work / "stubs.json"),
            ],
            "grader run collectives, every collective deadlocks": [
                *grader, "run", "collectives", "--submission", str(deadlocks),
                "--results", str(work / "deadlocks.json"),
            ],
        }  # fmt: skip
        medians, peaks = {}, {}
        for label, command in runs.items():
            measured = [timed(command, work) for _ in range(args.repeats)]
            medians[label] = statistics.median(m[0] for m in measured)
            peaks[label] = max(m[1] for m in measured)
        yardstick = next(iter(medians.values()))
        for label, seconds in medians.items():
            print(
                f"{label:<52} {seconds:6.1f} s {seconds / yardstick:5.1f}x"
                f"  peak {peaks[label]:6.0f} MB"
            )
        for name in ("reference", "stubs", "deadlocks"):
            results = json.loads((work / f"{name}.json").read_text())
            maximum = sum(t["max_score"] for t in results["tests"])
            print(
                f"{name}: {results['score']:g} / {maximum:g} points, {len(results['tests'])} tests"
            )


if __name__ == "__main__":
    main()
