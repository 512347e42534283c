"""Reads the Python stacks a stuck rank dumped (faulthandler) and keeps the student's frames."""

from __future__ import annotations

import re
from pathlib import Path

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<function>\S+)')


def student_stack(dump: str, import_dir: Path) -> list[str]:
    """The student's frames of the first thread in ``dump``, innermost first.

    faulthandler lists the thread that received the signal, the main thread
    here, first ("Current thread ..."), most recent call first.
    """
    root = str((import_dir / "assignments").resolve())
    frames = []
    for line in dump.split("\n\n")[0].splitlines():
        match = _FRAME.match(line)
        if match and match["file"].startswith(root):
            relative = match["file"][len(root) :].lstrip("/")
            frames.append(f"assignments/{relative}:{match['line']} in {match['function']}")
    return frames


def read_dump(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
