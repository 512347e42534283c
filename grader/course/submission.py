"""Finds a submission, checks it without running it, and stages it for the ranks to import.

The ranks import a private copy (``<job>/import/assignments``), so that a
student editing files while the grader runs cannot change what is graded, and
so that the package is always a regular package whatever the submission's
directory is called.

Students upload in three shapes (docs/submission.md): the module files at the
top level, inside ``assignments/``, or a whole repository one folder down
(GitHub's zip: ``repo-main/assignments/collectives.py``). :func:`find_modules`
finds the folder that holds them, for ``grader run`` and Gradescope alike.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Collection, Iterator
from pathlib import Path

from grader.course import config

REFERENCE_KEYWORD = "reference"
# The module files when the configuration is not at hand: the course's parts.
DEFAULT_MODULES = (
    "collectives.py",
    "data_parallel.py",
    "tensor_parallel.py",
    "pipeline_parallel.py",
    "fully_sharded.py",
    "expert_parallel.py",
    "context_parallel.py",
)
# Folders an archive or an operating system adds, never a student's repository.
_NOT_A_REPOSITORY = {"__MACOSX", "__pycache__"}


class SubmissionError(Exception):
    """The submission cannot be graded at all; the message is one line for the user."""


def resolve(argument: str | None, modules: Collection[str] = DEFAULT_MODULES) -> Path:
    """The folder of module files that ``--submission`` names (default: ``assignments/``)."""
    if argument is None:
        return config.REPO_ROOT / "assignments"
    if argument == REFERENCE_KEYWORD and not Path(argument).is_dir():
        if not (config.REPO_ROOT / "reference").is_dir():
            raise SubmissionError(
                "there is no reference in a student release "
                f"({config.REPO_ROOT} has no reference/): --submission names your own folder"
            )
        return config.REPO_ROOT / "reference"
    path = Path(argument).expanduser()
    if not path.exists():
        raise SubmissionError(f"no such directory: {argument}")
    if not path.is_dir():
        raise SubmissionError(f"--submission must be a directory, got a file: {argument}")
    return find_modules(path.resolve(), modules)


def find_modules(directory: Path, modules: Collection[str] = DEFAULT_MODULES) -> Path:
    """The folder holding the submission's module files (any of ``modules``).

    Looks at ``directory`` itself, then its ``assignments/``, then the same two
    places one folder down, the first that holds a module file winning. Two
    folders one level down that both hold them are ambiguous: grading either
    could grade the wrong work.
    """

    def holds(folder: Path) -> bool:
        return any((folder / name).is_file() for name in modules)

    for candidate in (directory, directory / "assignments"):
        if holds(candidate):
            return candidate
    below = sorted(
        child
        for child in directory.iterdir()
        if child.is_dir() and not child.name.startswith(".") and child.name not in _NOT_A_REPOSITORY
    )
    found = [
        next(c for c in (child, child / "assignments") if holds(c))
        for child in below
        if holds(child) or holds(child / "assignments")
    ]
    if len(found) == 1:
        return found[0]
    names = ", ".join(sorted(modules))
    if found:
        where = " and ".join(str(f.relative_to(directory)) for f in found[:2])
        raise SubmissionError(
            f"{directory} holds module files in more than one folder ({where}): "
            "upload one copy of your work"
        )
    raise SubmissionError(
        f"no module files in {directory}: expected one of {names} at its top level, "
        "in assignments/, or one folder down (a repository, e.g. repo-main/assignments/)"
    )


def problem_with(directory: Path, part: str) -> tuple[str, str, str] | None:
    """Why a part's module cannot be graded, as (outcome, message, cause), or None if it can.

    Only compiles the file: nothing of the student's runs in the grader's own process.
    """
    module = directory / f"{part}.py"
    if not module.is_file():
        return "not_run", f"not submitted: the submission has no {part}.py", "not_submitted"
    try:
        source = module.read_bytes()
        compile(source, f"assignments/{part}.py", "exec")
    except SyntaxError as err:
        message = f"assignments/{part}.py has a syntax error (line {err.lineno}): {err.msg}"
        return "error", message, "syntax_error"
    except (OSError, ValueError) as err:
        return "error", f"assignments/{part}.py cannot be read: {err}", "syntax_error"
    return None


def fingerprint(directory: Path) -> frozenset[tuple[str, int, int]]:
    """What :func:`stage` would copy, as (path, size, modification time) per file: it changes
    when a file of the submission is saved, added or removed (watch mode's cue to regrade)."""
    seen = set()
    for source in _candidates(directory):
        with contextlib.suppress(OSError):  # removed since it was listed: seen next time
            info = os.lstat(source)
            seen.add((str(source), info.st_size, info.st_mtime_ns))
    return frozenset(seen)


MAX_FILE_BYTES = 1 << 20
MAX_TOTAL_BYTES = 16 << 20
MAX_FILES = 500
_SKIPPED = {"__pycache__", ".git", "results.json"}


def _candidates(directory: Path) -> Iterator[Path]:
    """The submission's files that staging considers, in a stable order: not in a skipped
    or symlinked folder, not a skipped name or compiled bytecode."""
    for root, dirs, files in os.walk(directory, followlinks=False):
        here = Path(root)
        dirs[:] = [d for d in sorted(dirs) if d not in _SKIPPED and not (here / d).is_symlink()]
        for name in sorted(files):
            if name not in _SKIPPED and not name.endswith(".pyc"):
                yield here / name


def stage(directory: Path, import_dir: Path) -> list[str]:
    """Copy the submission's regular files to ``import_dir/assignments``, as a regular package.

    Only regular files are copied, each opened without following links and
    within size limits: a symlink (to the reference, say), a FIFO or a device
    in the submission is left out, never opened. The copy is what the ranks
    import, read-only, so that editing files while the grader runs changes
    nothing. The package's ``__init__.py`` is always empty: parts are graded
    one by one, and an ``__init__`` that imports every module would let one
    broken file cost the others. Returns what was left out, one line each.
    """
    target = import_dir / "assignments"
    target.mkdir(parents=True)
    left_out: list[str] = []
    total = count = 0
    for source in _candidates(directory):
        relative = source.relative_to(directory)
        try:
            descriptor = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            left_out.append(f"{relative}: not a regular file")
            continue
        with os.fdopen(descriptor, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                left_out.append(f"{relative}: not a regular file")
                continue
            if info.st_size > MAX_FILE_BYTES or total + info.st_size > MAX_TOTAL_BYTES:
                left_out.append(f"{relative}: too large ({info.st_size} bytes)")
                continue
            if count >= MAX_FILES:
                left_out.append(f"{relative}: too many files")
                continue
            content = f.read(MAX_FILE_BYTES + 1)
        total, count = total + len(content), count + 1
        destination = target / relative
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.write_bytes(content)
    (target / "__init__.py").write_text("")
    for path in [import_dir, *import_dir.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return left_out
