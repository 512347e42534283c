"""Runs the real `grader` command, as a user would, and reads what it reported."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
            if (
                title == name
                and extra["world_size"] == world_size
                and part in (None, extra["part"])
            ):
                return entry
        raise KeyError(f"no test {name} at world size {world_size} in {self.names()}")

    def outcome(self, name: str, world_size: int) -> str:
        return self.test(name, world_size)["extra_data"]["outcome"]

    def message(self, name: str, world_size: int) -> str:
        return self.test(name, world_size)["output"]

    def outcomes(self) -> dict[tuple[str, int], str]:
        return {
            (
                e["name"].split(": ", 1)[1].rsplit(" (world size", 1)[0],
                e["extra_data"]["world_size"],
            ): e["extra_data"]["outcome"]
            for e in self.tests
        }

    def names(self) -> list[str]:
        return [e["name"] for e in self.tests]


def run_grader(
    args: list[str], timeout: float = 600, cwd: Path = REPO
) -> subprocess.CompletedProcess:
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
