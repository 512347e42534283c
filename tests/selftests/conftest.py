"""The project's own tests: run the real `grader` command on submissions and read its verdicts.

Submissions live in ``submissions/<name>/``: broken ones written to fail in one
precise way each, so that the verdict a careful TA would give can be asserted,
along with every other test of theirs being unaffected.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SUBMISSIONS = Path(__file__).resolve().parent / "submissions"


@dataclass
class Graded:
    """One `grader run`: its exit status, its terminal output and its results.json."""

    returncode: int
    stdout: str
    stderr: str
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def tests(self) -> list[dict[str, Any]]:
        return self.results.get("tests", [])

    def test(self, name: str, world_size: int, part: str | None = None) -> dict[str, Any]:
        for entry in self.tests:
            extra = entry["extra_data"]
            title = entry["name"].split(": ", 1)[1].rsplit(" (world size", 1)[0]
            if title == name and extra["world_size"] == world_size and part in (None, extra["part"]):
                return entry
        raise KeyError(f"no test {name} at world size {world_size} in {self.names()}")

    def outcome(self, name: str, world_size: int) -> str:
        return self.test(name, world_size)["extra_data"]["outcome"]

    def message(self, name: str, world_size: int) -> str:
        return self.test(name, world_size)["output"]

    def outcomes(self) -> dict[tuple[str, int], str]:
        return {
            (e["name"].split(": ", 1)[1].rsplit(" (world size", 1)[0], e["extra_data"]["world_size"]):
            e["extra_data"]["outcome"]
            for e in self.tests
        }

    def names(self) -> list[str]:
        return [e["name"] for e in self.tests]


def run_grader(args: list[str], timeout: float = 600, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run `python -m grader ARGS`; on timeout, stop it as Ctrl-C would, then for good."""
    process = subprocess.Popen(
        [sys.executable, "-m", "grader", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"},
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)  # the grader ends its own jobs
        try:
            stdout, stderr = process.communicate(timeout=15)
        finally:
            os.killpg(process.pid, signal.SIGKILL) if process.poll() is None else None
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.fixture(scope="session")
def grade(tmp_path_factory: pytest.TempPathFactory):
    """``grade(submission, *parts, k=..., world_sizes=[...])``: a cached `grader run`."""
    cache: dict[tuple, Graded] = {}

    def run(submission: str, *parts: str, k: str | None = None, world_sizes: tuple[int, ...] = ()) -> Graded:
        key = (submission, parts, k, tuple(world_sizes))
        if key not in cache:
            out = tmp_path_factory.mktemp("results") / "results.json"
            path = {"reference": "reference", "stubs": str(REPO / "assignments")}.get(
                submission, str(SUBMISSIONS / submission)
            )
            args = ["run", *parts, "--submission", path, "--results", str(out)]
            args += ["-k", k] if k else []
            for size in world_sizes:
                args += ["--world-size", str(size)]
            done = run_grader(args)
            results = json.loads(out.read_text()) if out.exists() else {}
            cache[key] = Graded(done.returncode, done.stdout, done.stderr, results)
        return cache[key]

    return run
