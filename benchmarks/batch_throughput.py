"""Students per hour: 8 submissions graded by a ``grader run`` each, and by ``grader batch``.

    python benchmarks/batch_throughput.py [--rounds 1] [SELECTION ...]
    python benchmarks/batch_throughput.py collectives -k all_reduce     # the default

Eight students: four copies of the reference and four broken submissions of
``tests/selftests/submissions`` (a wrong answer, a deadlock, a syntax error, a naive
all-reduce). Each round grades them twice, side by side on this machine as it is:
one ``grader run --submission S --results F`` after another (how a batch graded each
student before its workers: every student paid the grader's start-up, the sandbox's probe
and the reference's job), and one ``grader batch --jobs 1`` (its workers pay them once).
The two orders alternate from round to round, so that neither always meets the machine
first. Prints each path's students per hour, and whether every student's verdicts are
identical test by test (outcome and points): the speed must change nothing else.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "selftests"))
from runner import materialize  # noqa: E402 - the self-tests' helper, found above

BROKEN = ("coll_wrong", "coll_deadlock_all", "coll_syntax", "coll_unusual")
DEFAULT_SELECTION = ["collectives", "-k", "all_reduce"]


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


def one_run_each(root: Path, names: list[str], out: Path, selection: list[str]) -> float:
    """Seconds to grade every student by a ``grader run`` of its own, one after another."""
    start = time.monotonic()
    for name in names:
        (out / name).mkdir(parents=True)
        command = [sys.executable, "-m", "grader", "run", *selection]
        command += ["--submission", str(root / name), "--results", str(out / name / "results.json")]
        subprocess.run(command, cwd=REPO, capture_output=True, check=False)
    return time.monotonic() - start


def batch(root: Path, out: Path, selection: list[str]) -> float:
    """Seconds to grade every student by ``grader batch --jobs 1``."""
    start = time.monotonic()
    command = [sys.executable, "-m", "grader", "batch", str(root), "--out", str(out), "--jobs", "1"]
    subprocess.run([*command, *selection], cwd=REPO, capture_output=True, check=False)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    args, selection = parser.parse_known_args()
    selection = selection or DEFAULT_SELECTION
    seconds: dict[str, list[float]] = {"one run each": [], "batch": []}
    identical = True
    with tempfile.TemporaryDirectory(prefix="batch-throughput-") as tmp:
        root = Path(tmp) / "class"
        root.mkdir()
        names = make_class(root)
        for i in range(args.rounds):
            old, new = Path(tmp) / f"old{i}", Path(tmp) / f"new{i}"
            paths = [
                ("one run each", partial(one_run_each, root, names, old, selection)),
                ("batch", partial(batch, root, new, selection)),
            ]
            for label, grade in paths if i % 2 == 0 else paths[::-1]:
                seconds[label].append(grade())
                print(f"round {i + 1}: {label}: {seconds[label][-1]:.0f} s", flush=True)
            differences = compare(names, old, new)
            identical = identical and not differences
            for line in differences:
                print(f"  differs: {line}")
    print(f"{len(names)} students, selection: {' '.join(selection)}")
    for label, times in seconds.items():
        mean = sum(times) / len(times)
        print(f"  {label:<13} {mean:6.0f} s   {len(names) * 3600 / mean:6.1f} students per hour")
    ratio = sum(seconds["one run each"]) / sum(seconds["batch"])
    print(f"  batch: {ratio:.2f}x the students per hour")
    print("verdicts identical test by test" if identical else "VERDICTS DIFFER")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
