"""``grader gradescope OUT.zip``: Gradescope's autograder zip, built from the course directory.

Gradescope unpacks the zip into ``/autograder/source``, runs ``setup.sh`` once
when it builds its image, and ``run_autograder`` for every submission; both
must sit at the zip's root. Next to them goes what ``setup.sh`` installs: the
package, the reference, the graded tests and the stubs. Nothing else: not the
project's own tests (``tests/selftests`` holds near-solutions), not ``.git``,
caches, results or build outputs.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import grader
from grader.course import config as course
from grader.course.config import ConfigError, GradingConfig

SCRIPTS = ("setup.sh", "run_autograder")
# What setup.sh installs and run_autograder grades with, relative to the course directory.
INCLUDED = ("pyproject.toml", "README.md", "LICENSE", "grader", "assignments", "reference", "docs")
_SKIPPED_NAMES = {
    ".git",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".venv",
    "build",
    "dist",
    "results.json",
    ".DS_Store",
}
_SKIPPED_SUFFIXES = (".pyc", ".egg-info")
_EXECUTABLE = 0o755
Entry = tuple[Path, str]  # a file of the course and its path in what is shipped


def build_zip(config: GradingConfig, output: Path) -> Path:
    """Write the autograder zip for ``config``'s course to ``output``; returns its path."""
    root = course.course_root(config.path)
    scripts = [root / "gradescope" / name for name in SCRIPTS]
    for script in scripts:
        if not script.is_file():
            raise ConfigError(f"cannot build the Gradescope zip: {script} does not exist")
    for needed in ("pyproject.toml", "reference"):
        if not (root / needed).exists():
            raise ConfigError(f"cannot build the Gradescope zip: {root} has no {needed}")
    output = output.expanduser().resolve()
    if not output.parent.is_dir():
        raise ConfigError(f"cannot write {output}: no such directory {output.parent}")
    entries = [(script, script.name) for script in scripts]
    entries += course_files(config, INCLUDED, output)
    try:
        with zipfile.ZipFile(output, "w", zipfile.ZIP_DEFLATED) as archive:
            for path, name in entries:
                _add(archive, path, name, executable=name in SCRIPTS)
    except OSError as err:
        raise ConfigError(f"cannot write {output}: {err.strerror}") from err
    return output


def course_files(config: GradingConfig, names: Iterable[str], output: Path) -> list[Entry]:
    """What of ``config``'s course is shipped, as (file, path in the output).

    ``names`` are top-level files and folders of the course directory, taken
    with ``tests/graded/`` (the configuration in use as ``grading.yaml``, which
    is where the installed grader looks), without caches, build outputs,
    results, links or ``output`` itself. Shared by the Gradescope zip and the
    student release (:mod:`grader.commands.release`), so that both ship the same way.
    """
    root = course.course_root(config.path)
    graded = config.path.parent
    entries: list[Entry] = []
    for name in names:
        source = root / name
        if name == "grader" and not source.is_dir():
            source = Path(grader.__file__).resolve().parent  # a course directory without a checkout
        for file in _files(source, output):
            entries.append((file, name if file == source else f"{name}/{file.relative_to(source)}"))
    entries += [(f, f"tests/graded/{f.relative_to(graded)}") for f in _files(graded, output)]
    if graded != root / "tests" / "graded" or config.path.name != "grading.yaml":
        entries = [e for e in entries if e[1] != "tests/graded/grading.yaml"]
        entries.append((config.path, "tests/graded/grading.yaml"))
    return entries


def _files(source: Path, output: Path) -> Iterator[Path]:
    """The files under ``source`` (or ``source`` itself) that are shipped, sorted."""
    if source.is_file():
        yield source
        return
    if not source.is_dir():
        return
    for folder, dirs, files in os.walk(source):
        dirs[:] = sorted(d for d in dirs if not _skipped(d))
        for name in sorted(files):
            path = Path(folder) / name
            if (
                not _skipped(name)
                and not path.resolve().is_relative_to(output)
                and not path.is_symlink()
            ):
                yield path


def _skipped(name: str) -> bool:
    skipped = name in _SKIPPED_NAMES or name.endswith(_SKIPPED_SUFFIXES)
    return skipped or name.startswith(".results-")


def _add(archive: zipfile.ZipFile, path: Path, name: str, executable: bool) -> None:
    """Add one file, keeping its permission bits (the scripts must stay executable)."""
    info = zipfile.ZipInfo.from_file(path, name)
    mode = _EXECUTABLE if executable else path.stat().st_mode & 0o777
    info.external_attr = (0o100000 | mode) << 16  # a regular file with these bits
    info.compress_type = zipfile.ZIP_DEFLATED
    archive.writestr(info, path.read_bytes())
