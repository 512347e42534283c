"""`grader batch`'s workers grade each student as a `grader run` of its own would, test by
test, and nothing of one student reaches the next, whatever the order.

A worker grades student after student (grader/commands/worker.py): what it shares between
them is the trusted side's own (the sandbox level, the reference's job). With `--jobs 1`
the students go to one worker in their names' order: a wrong answer first, then twice
`watch_remembers`, the reference that fails its import if its rank sees a mark an earlier
grading left (in its scratch folder, /tmp, /dev/shm) or finds itself imported before. Each
earns what a `grader run` of its own gives it. A student with no module file ends its
worker (the grader could not grade it); a fresh worker grades the next.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from runner import REPO, materialize, run_grader

SELECTION = ["collectives", "-k", "broadcast", "--world-size", "2"]


def _verdicts(results: Path) -> dict[str, tuple[str, float]]:
    tests = json.loads(results.read_text())["tests"]
    return {t["name"]: (t["status"], t["score"]) for t in tests}


def _alone(tmp_path: Path, submission: Path) -> dict[str, tuple[str, float]]:
    """The verdicts of a `grader run` of the submission's own."""
    results = tmp_path / f"{submission.name}.json"
    command = ["run", *SELECTION, "--submission", str(submission), "--results", str(results)]
    run_grader(command, timeout=600)
    return _verdicts(results)


def _class(root: Path) -> None:
    """Five students, in the order one worker meets them."""
    materialize("coll_wrong", root)
    (root / "coll_wrong").rename(root / "a_wrong")
    materialize("watch_remembers", root)
    (root / "watch_remembers").rename(root / "b_remembers")
    shutil.copytree(root / "b_remembers", root / "c_remembers_again")
    (root / "d_nothing_handed_in").mkdir()
    shutil.copytree(REPO / "reference", root / "e_reference")


def test_a_batch_gives_each_student_the_verdicts_of_a_run_of_its_own(tmp_path: Path) -> None:
    root, out = tmp_path / "class", tmp_path / "out"
    _class(root)

    command = ["batch", str(root), "--out", str(out), "--jobs", "1", *SELECTION]
    done = run_grader(command, timeout=900)

    assert done.returncode == 1, done.stdout + done.stderr  # one student has no row
    assert "d_nothing_handed_in: the grader could not grade it (exit status 2)" in done.stderr
    batch = {s: _verdicts(out / s / "results.json") for s in ("a_wrong", "c_remembers_again")}
    assert batch["a_wrong"] == _alone(tmp_path, root / "a_wrong")
    assert any(status == "failed" for status, _ in batch["a_wrong"].values())
    remembers = _alone(tmp_path, root / "c_remembers_again")
    assert all(status == "passed" for status, _ in remembers.values())
    for student in ("b_remembers", "c_remembers_again", "e_reference"):  # the same code
        assert _verdicts(out / student / "results.json") == remembers, student
