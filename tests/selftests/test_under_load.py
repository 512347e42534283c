"""A grade is a fact about the submission, not about the machine's load.

Three broken submissions are graded one at a time on a quiet machine, then
side by side with a busy loop on every core: every test must get the same
outcome, the same message and the same score. (Nothing is timed: the broker
sees deadlocks and mismatches exactly, and cost tests replay message
patterns instead of reading a clock.)
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from runner import REPO, materialize

SELECTIONS = {  # a broken submission each, on a few tests, to keep it short
    "coll_wrong": ["collectives", "-k", "all_reduce", "--world-size", "3"],
    "dp_sums_not_averages": ["data_parallel", "-k", "training", "--world-size", "2"],
    "pp_blocking_send_1f1b": ["pipeline_parallel", "-k", "one_f_one_b", "--world-size", "2"],
}


def _command(submission: Path, selection: list[str], results: Path) -> list[str]:
    config = str(REPO / "tests" / "graded" / "grading.yaml")
    return [sys.executable, "-m", "grader", "--config", config, "run", *selection,
            "--submission", str(submission), "--results", str(results)]  # fmt: skip


def _verdicts(results: Path) -> dict[str, tuple[str, str, float]]:
    """Each test's outcome, message and score (a message's own timing left out)."""
    tests = json.loads(results.read_text())["tests"]
    untimed = re.compile(r"\(stopped after \d+ s\)")
    return {
        t["name"]: (t["extra_data"]["outcome"], untimed.sub("", t["output"]), t["score"])
        for t in tests
    }


def _spin() -> None:
    while True:
        pass


def test_three_graders_and_a_cpu_hog_give_the_verdicts_of_a_quiet_machine(tmp_path: Path) -> None:
    submissions = {name: materialize(name, tmp_path / "submissions") for name in SELECTIONS}
    quiet = {}
    for name, selection in SELECTIONS.items():
        results = tmp_path / f"{name}-quiet.json"
        subprocess.run(_command(submissions[name], selection, results), capture_output=True)
        quiet[name] = _verdicts(results)
    hogs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(os.cpu_count() or 2)]
    running: dict[str, subprocess.Popen] = {}
    for hog in hogs:
        hog.start()
    try:
        running = {
            name: subprocess.Popen(
                _command(submissions[name], selection, tmp_path / f"{name}-loaded.json"),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            for name, selection in SELECTIONS.items()
        }
        for process in running.values():
            process.wait(timeout=600)
    finally:
        for hog in hogs:
            hog.kill()
        for process in running.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    for name in SELECTIONS:
        loaded = _verdicts(tmp_path / f"{name}-loaded.json")
        assert loaded == quiet[name], name
        assert any(outcome != "passed" for outcome, _, _ in loaded.values()), name
