"""Finds the submission's own frames in a stack, to point a student at their line."""

from __future__ import annotations

import functools
import sys
import traceback
from pathlib import Path
from types import TracebackType

_student_root: Path | None = None


def configure(import_dir: Path) -> None:
    """Files under ``import_dir/assignments`` are the student's."""
    global _student_root
    _student_root = (import_dir / "assignments").resolve()
    is_student_file.cache_clear()
    display_path.cache_clear()


@functools.lru_cache(maxsize=1024)
def is_student_file(filename: str) -> bool:
    if _student_root is None:
        return False
    try:
        return Path(filename).resolve().is_relative_to(_student_root)
    except (OSError, ValueError):
        return False


@functools.lru_cache(maxsize=1024)
def display_path(filename: str) -> str:
    """``assignments/collectives.py`` rather than a temporary directory's full path."""
    if _student_root is not None and is_student_file(filename):
        return str(Path("assignments") / Path(filename).resolve().relative_to(_student_root))
    return filename


def student_location() -> str:
    """The innermost student frame of the current stack, as 'file:line in function'."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if is_student_file(code.co_filename):
            return f"{display_path(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
        frame = frame.f_back
    return ""


def student_frames(tb: TracebackType | None) -> list[str]:
    """The student's frames of a traceback, outermost first, each with its source line."""
    lines = []
    for summary in traceback.extract_tb(tb):
        if is_student_file(summary.filename):
            where = f"{display_path(summary.filename)}:{summary.lineno} in {summary.name}"
            lines.append(f"{where}: {summary.line.strip()}" if summary.line else where)
    return lines


def innermost_student_function(tb: TracebackType | None) -> str:
    """The qualified name (with its class) of the innermost student function in a traceback."""
    name = ""
    while tb is not None:
        code = tb.tb_frame.f_code
        if is_student_file(code.co_filename):
            name = getattr(code, "co_qualname", code.co_name)
        tb = tb.tb_next
    return name
