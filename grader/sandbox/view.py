"""What the ranks of a job see of this machine: the sandbox's hiding policy, as data.

Every sandbox level applies the same two lists: :func:`hidden` (hidden from the ranks) and
:func:`interpreter` (bound back readable, for Python and torch). The ``namespaces`` level
hides by mounting over them, the ``uid`` level by permissions that it checks first.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from grader.course import config as course
from grader.course.secret import secret_path

# What the ranks see of the machine's root: the system, nothing else (another checkout of the
# course, with its reference, may lie anywhere outside these).
_SYSTEM = {"bin", "boot", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "run", "sbin",
           "sys", "tmp", "usr"}  # fmt: skip


def hidden(work: Path) -> list[Path]:
    """What the ranks must not see: every top-level directory but the system's (the course's
    checkouts, with the reference, the hidden tests and the configuration; home directories;
    the secret), the grader's work directory, and the course wherever it lies."""
    tops = [Path("/") / name for name in sorted(os.listdir("/")) if name not in _SYSTEM]
    return [*tops, course.REPO_ROOT, work, Path.home(), secret_path().parent]


def interpreter() -> list[Path]:
    """What the ranks need back: Python, and the directories it imports packages from (torch),
    but not the directory the grader was started in, nor anything inside the course."""
    found = [Path(sys.base_prefix), Path(sys.prefix)]
    for entry in sys.path[1:]:
        path = Path(entry).resolve() if entry else None
        if path and path.is_dir() and not path.is_relative_to(course.REPO_ROOT.resolve()):
            found.append(path)
    return list(dict.fromkeys(found))
