"""Finds a submission, checks it without running it, and stages it for the ranks to import.

The ranks import a private copy (``<job>/import/assignments``), so that a
student editing files while the grader runs cannot change what is graded, and
so that the package is always a regular package whatever the submission's
directory is called.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from grader.config import REPO_ROOT

REFERENCE_KEYWORD = "reference"


class SubmissionError(Exception):
    """The submission cannot be graded at all; the message is one line for the user."""


def resolve(argument: str | None) -> Path:
    """The directory named by ``--submission`` (default: the repository's ``assignments/``)."""
    if argument is None:
        return REPO_ROOT / "assignments"
    if argument == REFERENCE_KEYWORD and not Path(argument).is_dir():
        return REPO_ROOT / "reference"
    path = Path(argument).expanduser()
    if not path.exists():
        raise SubmissionError(f"no such directory: {argument}")
    if not path.is_dir():
        raise SubmissionError(f"--submission must be a directory, got a file: {argument}")
    return path.resolve()


def problem_with(directory: Path, part: str) -> tuple[str, str] | None:
    """Why a part's module cannot be graded, as (outcome, message), or None if it can.

    Only compiles the file: nothing of the student's runs in the grader's own process.
    """
    module = directory / f"{part}.py"
    if not module.is_file():
        return "not_run", f"not submitted: the submission has no {part}.py"
    try:
        source = module.read_bytes()
        compile(source, f"assignments/{part}.py", "exec")
    except SyntaxError as err:
        return "error", f"assignments/{part}.py has a syntax error (line {err.lineno}): {err.msg}"
    except (OSError, ValueError) as err:
        return "error", f"assignments/{part}.py cannot be read: {err}"
    return None


def stage(directory: Path, import_dir: Path) -> None:
    """Copy the submission to ``import_dir/assignments`` as a regular package.

    The package's ``__init__.py`` is always empty: parts are graded one by one,
    and an ``__init__`` that imports every module would let one broken file
    cost the others.
    """
    target = import_dir / "assignments"
    shutil.copytree(
        directory,
        target,
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".git", "results.json"),
        symlinks=False,
    )
    (target / "__init__.py").write_text("")
