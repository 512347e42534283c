"""`grader batch`'s workers grade each student as a `grader run` of its own would, test by
test, and nothing of one student reaches the next.

A worker grades student after student (grader/commands/worker.py): what it shares between
them is the trusted side's own (the sandbox level, the reference's job). Two students hand
in `watch_remembers`, the reference that fails its import if its rank sees a mark an earlier
grading left (in its scratch folder, /tmp, /dev/shm) or finds itself imported before: graded
one after the other by one worker, both earn every point. A student with no module file
ends its worker (the grader could not grade it); a fresh worker grades the next.
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


def test_a_batch_gives_each_student_the_verdicts_of_a_run_of_its_own(tmp_path: Path) -> None:
    root = tmp_path / "class"
    materialize("watch_remembers", root)
    shutil.copytree(root / "watch_remembers", root / "watch_remembers_again")
    materialize("coll_wrong", root)
    (root / "nothing_handed_in").mkdir()
    shutil.copytree(REPO / "reference", root / "reference_copy")
    out = tmp_path / "out"

    done = run_grader(["batch", str(root), "--out", str(out), *SELECTION], timeout=900)

    assert done.returncode == 1, done.stdout + done.stderr  # one student has no row
    assert "nothing_handed_in: the grader could not grade it (exit status 2)" in done.stderr
    graded = ["coll_wrong", "reference_copy", "watch_remembers", "watch_remembers_again"]
    for student in graded:
        alone = tmp_path / f"{student}.json"
        command = ["run", *SELECTION, "--submission", str(root / student), "--results", str(alone)]
        run_grader(command, timeout=600)
        in_batch = _verdicts(out / student / "results.json")
        assert in_batch == _verdicts(alone), student
    for student in ("reference_copy", "watch_remembers", "watch_remembers_again"):
        scores = _verdicts(out / student / "results.json").values()
        assert all(status == "passed" for status, _ in scores), student
    wrong = _verdicts(out / "coll_wrong" / "results.json").values()
    assert any(status == "failed" for status, _ in wrong)
