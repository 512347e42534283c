"""How `grader bench`'s ranks report to it: one JSON record per line in a file per rank.

The bench runs the student's code over gloo, not through the broker, so its
figures are measurements for the student's eyes, never grades.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def report_path(job_dir: Path, rank: int) -> Path:
    return job_dir / f"rank{rank}.jsonl"


def log_path(job_dir: Path, rank: int) -> Path:
    return job_dir / f"rank{rank}.log"


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
                data = f.read(1 << 20)
        except FileNotFoundError:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        records = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line torn by a dying process carries nothing
            if isinstance(record, dict):
                records.append(record)
        return records
