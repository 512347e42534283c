"""How the supervising grader and the ranks of a job talk: files in one job directory.

The supervisor writes ``plan.json`` (what to run); each rank appends one JSON
record per line to its own ``rank<r>.jsonl`` (what happened). Files, not
sockets, because a rank may die at any moment: every line that was flushed
before the death is still there for the supervisor to read, and the
supervisor never depends on a rank's cooperation to learn that it is gone.

Records, in the order a rank writes them:

    {"event": "ready", "rank": r, "pid": p}
    {"event": "start", "test": id, "time": t}
    {"event": "importing", "test": id, "module": m}   (around the submission's import)
    {"event": "imported", "test": id, "module": m}
    {"event": "end", "test": id, "time": t, "outcome": o, "message": s, "extra": {...}}
    {"event": "finished"}
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Outcomes of one test on one rank, and of the whole test once judged.
PASSED = "passed"
FAILED = "failed"
ERROR = "error"
TIMEOUT = "timeout"
CRASHED = "crashed"
FORBIDDEN = "forbidden"
NOT_RUN = "not_run"
OUTCOMES = (PASSED, FAILED, ERROR, TIMEOUT, CRASHED, FORBIDDEN, NOT_RUN)


@dataclass(frozen=True)
class PlannedTest:
    """One graded test at one world size, as a rank needs to know it."""

    id: str
    nodeid: str
    part: str
    op_timeout: float
    forbid_collectives: bool
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    tests: list[PlannedTest]
    import_dir: str
    backend: str
    attempt: int

    def write(self, job_dir: Path) -> None:
        (job_dir / "plan.json").write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def read(cls, job_dir: Path) -> Plan:
        raw = json.loads((job_dir / "plan.json").read_text())
        raw["tests"] = [PlannedTest(**t) for t in raw["tests"]]
        return cls(**raw)


def report_path(job_dir: Path, rank: int) -> Path:
    return job_dir / f"rank{rank}.jsonl"


def stacks_path(job_dir: Path, rank: int) -> Path:
    return job_dir / f"rank{rank}.stacks"


def waiting_path(job_dir: Path, rank: int) -> Path:
    """Where a rank keeps, while it blocks in a communication call, what it waits for."""
    return job_dir / f"rank{rank}.waiting"


def log_path(job_dir: Path, rank: int) -> Path:
    return job_dir / f"rank{rank}.log"


def skip_path(job_dir: Path) -> Path:
    """The tests the supervisor no longer wants run (their verdict is already known)."""
    return job_dir / "skip.json"


def read_skips(job_dir: Path) -> set[str]:
    try:
        return set(json.loads(skip_path(job_dir).read_text()))
    except (OSError, ValueError):
        return set()


def write_skips(job_dir: Path, ids: set[str]) -> None:
    temporary = skip_path(job_dir).with_suffix(".tmp")
    temporary.write_text(json.dumps(sorted(ids)))
    os.replace(temporary, skip_path(job_dir))


class ReportWriter:
    """Appends records to a rank's report; each record is on disk once ``write`` returns."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, **fields}, default=str) + "\n"
        os.write(self._fd, line.encode())


class ReportReader:
    """Reads the complete lines a rank has appended since the last call."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._offset = 0
        self._partial = b""

    def new_records(self) -> list[dict[str, Any]]:
        try:
            with open(self._path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        records = []
        for line in lines:
            try:
                records.append(json.loads(line))
            except ValueError:
                continue  # a line torn by a dying process carries no verdict
        return records
