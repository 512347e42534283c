"""Students per hour: 8 submissions graded by a ``grader run`` each, and by ``grader batch``.

    python benchmarks/batch_throughput.py [--rounds N] [--sandbox LEVEL] [--before REV] [SELECTION]
    python benchmarks/batch_throughput.py collectives -k all_reduce     # the default
    python benchmarks/batch_throughput.py --sandbox uid --before 84b7f09

Eight students: four copies of the reference and four broken submissions of
``tests/selftests/submissions`` (a wrong answer, a deadlock, a syntax error, a naive
all-reduce). Each round grades them with every path, side by side on this machine as it is:
one ``grader run --submission S --results F`` after another (how a batch graded each
student before its workers: every student paid the grader's start-up, the sandbox's probe
and the reference's job), and one ``grader batch --jobs 1`` (its workers pay them once);
with ``--before REV``, also the ``grader batch`` of that revision of this repository (a
worktree of it, with its own course), the path a course had then. The paths' order turns
from round to round, so that none always meets the machine first.

``--sandbox``: the level every path grades at (``$GRADER_SANDBOX``, which every revision's
batch hands its runs). At ``uid``, the level a course deploys, each grader runs on
``$GRADER_UID_PYTHON`` (default ``/opt/grader-venv/bin/python``: an interpreter every uid
may run) with a copy of its course made unreadable to others, as the deployment asks.

Prints each path's students per hour, the ratios to the first path, and whether every
student's verdicts are identical test by test (outcome and points) on every path: the
speed must change nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "selftests"))
from runner import materialize  # noqa: E402 - the self-tests' helper, found above

BROKEN = ("coll_wrong", "coll_deadlock_all", "coll_syntax", "coll_unusual")
DEFAULT_SELECTION = ["collectives", "-k", "all_reduce"]
UID_PYTHON = os.environ.get("GRADER_UID_PYTHON", "/opt/grader-venv/bin/python")
COURSE = ("reference", "assignments", "tests/graded")


@dataclass(frozen=True)
class Grader:
    """One checkout's grader, as a path runs it: its interpreter, folder and environment."""

    checkout: Path
    python: str
    env: dict[str, str]

    def command(self, *args: str) -> list[str]:
        return [self.python, "-m", "grader", *args]

    def run(self, args: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": str(self.checkout), **self.env}
        subprocess.run(self.command(*args), cwd=self.checkout, env=env, capture_output=True)


def grader_of(checkout: Path, level: str, scratch: Path) -> Grader:
    """The grader of ``checkout`` at ``level`` (``auto``: the strongest here); at ``uid`` on
    its course copied into ``scratch``, unreadable to others."""
    if level != "uid":
        return Grader(checkout, sys.executable, {"GRADER_SANDBOX": level})
    course = scratch / "course"
    for name in COURSE:
        shutil.copytree(checkout / name, course / name)
    subprocess.run(["chmod", "-R", "o-rwx", str(course)], check=True)
    config = str(course / "tests" / "graded" / "grading.yaml")
    return Grader(checkout, UID_PYTHON, {"GRADER_SANDBOX": level, "GRADER_CONFIG": config})


def make_class(root: Path) -> list[str]:
    """Eight students' folders in ``root``: four references, four broken ones."""
    names = []
    for i in range(4):
        names.append(f"reference_{i}")
        shutil.copytree(REPO / "reference", root / names[-1])
    for broken in BROKEN:
        names.append(broken)
        materialize(broken, root)  # self-contained, as a student hands it in
    return names


def one_run_each(by: Grader, root: Path, names: list[str], out: Path, select: list[str]) -> float:
    """Seconds to grade every student by a ``grader run`` of its own, one after another."""
    start = time.monotonic()
    for name in names:
        (out / name).mkdir(parents=True)
        submission = ["--submission", str(root / name)]
        by.run(["run", *select, *submission, "--results", str(out / name / "results.json")])
    return time.monotonic() - start


def batch(by: Grader, root: Path, out: Path, select: list[str]) -> float:
    """Seconds to grade every student by ``grader batch --jobs 1``."""
    start = time.monotonic()
    by.run(["batch", str(root), "--out", str(out), "--jobs", "1", *select])
    return time.monotonic() - start


def verdicts(out: Path, name: str) -> dict[str, tuple[str, float]] | None:
    """Each test's outcome and points in the student's results.json; None if it has none."""
    try:
        results = json.loads((out / name / "results.json").read_text())
    except (OSError, ValueError):
        return None
    return {t["name"]: (t["status"], t["score"]) for t in results["tests"]}


def compare(names: list[str], old: Path, new: Path) -> list[str]:
    """Every difference between the two paths' verdicts, one line each."""
    differences = []
    for name in names:
        before, after = verdicts(old, name), verdicts(new, name)
        if before is None or after is None:
            differences.append(f"{name}: no results.json from one path")
            continue
        for test in sorted(set(before) | set(after)):
            if before.get(test) != after.get(test):
                differences.append(f"{name}: {test}: {before.get(test)} vs {after.get(test)}")
    return differences


def worktree(revision: str, where: Path) -> Path:
    """A checkout of ``revision`` of this repository at ``where``."""
    command = ["git", "-C", str(REPO), "worktree", "add", "--detach", str(where), revision]
    subprocess.run(command, check=True, capture_output=True)
    # Readable, as an install of it would be: a grader of before the ranks imported a copy of
    # the grader (view.rank_side) imports it from there. Its course is copied, unreadable.
    where.parent.chmod(0o711)
    return where


Grading = Callable[[Path], float]  # grades the class into a folder; its seconds


def paths(args: argparse.Namespace, tmp: Path, names: list[str]) -> dict[str, Grading]:
    """Each path, by its label; the first is the one the others are compared with."""
    root, select = tmp / "class", args.selection
    now = grader_of(REPO, args.sandbox, tmp / "now")
    graded: dict[str, Grading] = {
        "one run each": lambda out: one_run_each(now, root, names, out, select),
        "batch": lambda out: batch(now, root, out, select),
    }
    if args.before:
        then = grader_of(worktree(args.before, tmp / "before"), args.sandbox, tmp / "then")
        graded[f"{args.before} batch"] = lambda out: batch(then, root, out, select)
    return graded


def rounds(
    graded: dict[str, Grading], count: int, tmp: Path, names: list[str]
) -> tuple[dict[str, list[float]], bool]:
    """Every path's seconds in each of ``count`` rounds (printed as each ends), and whether
    every path's verdicts were identical every time."""
    seconds: dict[str, list[float]] = {label: [] for label in graded}
    identical = True
    for i in range(count):
        labels = list(graded)[i % len(graded) :] + list(graded)[: i % len(graded)]
        for label in labels:
            seconds[label].append(graded[label](tmp / str(i) / label))
            print(f"round {i + 1}: {label}: {seconds[label][-1]:.0f} s", flush=True)
        outs = [tmp / str(i) / label for label in graded]
        differences = [d for out in outs[1:] for d in compare(names, outs[0], out)]
        identical = identical and not differences
        for line in differences:
            print(f"  differs: {line}")
    return seconds, identical


def report(seconds: dict[str, list[float]], names: list[str], args: argparse.Namespace) -> None:
    level = "the strongest here" if args.sandbox == "auto" else args.sandbox
    print(f"{len(names)} students, selection: {' '.join(args.selection)}, sandbox: {level}")
    mean = {label: sum(times) / len(times) for label, times in seconds.items()}
    for label, value in mean.items():
        print(f"  {label:<16} {value:6.0f} s   {len(names) * 3600 / value:6.1f} students per hour")
    for label in (label for label in mean if label != "batch"):
        print(f"  batch: {mean[label] / mean['batch']:.2f}x the students per hour of {label}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--sandbox", default="auto", help="the level every path grades at")
    parser.add_argument("--before", help="a revision whose grader batch grades the class too")
    args, args.selection = parser.parse_known_args()
    args.selection = args.selection or DEFAULT_SELECTION
    with tempfile.TemporaryDirectory(prefix="batch-throughput-") as name:
        tmp = Path(name)
        (tmp / "class").mkdir()
        names = make_class(tmp / "class")
        try:
            seconds, identical = rounds(paths(args, tmp, names), args.rounds, tmp, names)
        finally:
            if args.before:
                command = ["git", "-C", str(REPO), "worktree", "remove", "--force"]
                subprocess.run([*command, str(tmp / "before")], capture_output=True)
    report(seconds, names, args)
    print("verdicts identical test by test" if identical else "VERDICTS DIFFER")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
