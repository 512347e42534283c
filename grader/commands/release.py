"""``grader release OUT``: the repository students get, written from the course directory.

What is shipped is an allow-list (:data:`RELEASED`), so that whatever an
instructor adds to the course directory stays private until it is named here:
``reference/``, ``tests/selftests`` (its broken submissions are near-solutions),
``deploy/``, ``.github/``, ``gradescope/``, the benchmarks (they run the
reference), ``.git``, caches, results and build outputs are never copied. The
files are chosen as the Gradescope zip chooses them
(:func:`grader.commands.gradescope.course_files`); the grader's data (the reference's
message patterns, the machine models) travels inside ``grader/``, so the
release grades the cost tests as the course does, without a reference.

Of ``tests/graded/``, an allow-list too: the configuration, pytest's own
files (``conftest.py``, ``pytest.ini``), the graded test files students may
see, and what those use (:func:`_used_by`): the modules of the folder they
import, and the files they name (by file name or by path from the folder),
and so on for what those use. A hidden test's data file, a helper only hidden
tests import, notes: nothing else ships (:attr:`Release.private` names them).

A graded test file whose every test is hidden from students before grading
(``hidden``, ``after_due_date`` or ``after_published`` in ``grading.yaml``:
anything but ``visible``) is left out, and the configuration is rewritten
without it, so that the release's own ``grading.yaml`` loads. A file with some
hidden tests is shipped whole (a file cannot be split), with what it uses:
:attr:`Release.partly_hidden` names it, for a warning.
"""

from __future__ import annotations

import ast
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from grader.commands.gradescope import course_files
from grader.course.config import ConfigError, GradingConfig, load_config

# Top-level files and folders of the course directory that students get (with tests/graded/).
RELEASED = ("pyproject.toml", "README.md", "LICENSE", ".gitignore", "grader", "assignments", "docs")
_GRADED = "tests/graded/"
_CONFIG_NAME = _GRADED + "grading.yaml"
_PYTEST_FILES = ("conftest.py", "pytest.ini")  # what pytest itself reads in the folder
_REWRITTEN_HEADER = (
    "# The student release's grading configuration, written by `grader release`:\n"
    "# the graded test files whose every test is hidden are left out.\n"
)


@dataclass(frozen=True)
class Release:
    """What ``grader release`` wrote: where, which test files it left out, which it warns of."""

    path: Path
    left_out: tuple[str, ...]  # graded test files (from tests/graded/) whose every test is hidden
    partly_hidden: tuple[str, ...]  # shipped graded test files that hold hidden tests
    private: tuple[str, ...] = ()  # other files of tests/graded/ that no shipped test uses


def build_release(config: GradingConfig, output: Path) -> Release:
    """Write the student release of ``config``'s course into ``output`` (absent or empty).

    A folder that holds anything is refused rather than merged into: what was
    there would ship with the release, or be overwritten.
    """
    output = output.expanduser().resolve()
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ConfigError(f"cannot release into {output}: it exists and is not an empty folder")
    hidden, partly = _hidden_files(config)
    everything = course_files(config, RELEASED, output)
    graded = {name.removeprefix(_GRADED) for _, name in everything if name.startswith(_GRADED)}
    shown = {_relative(f, config) for p in config.parts.values() for f in p.files} - hidden
    used = _used_by(config.path.parent, shown | set(_PYTEST_FILES), graded - hidden)
    shipped = {_GRADED + name for name in used} | {_CONFIG_NAME}
    entries = [
        (file, name)
        for file, name in everything
        if (name in shipped or not name.startswith(_GRADED))
        and not (hidden and name == _CONFIG_NAME)
    ]
    private = sorted(graded - used - hidden - {"grading.yaml"})
    if hidden:
        remaining = _config_without(config, hidden)
        if not remaining["parts"]:
            raise ConfigError(f"{config.path}: every graded test is hidden: nothing to release")
    try:
        for file, name in entries:
            target = output / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(file, target)  # keeps the modes: the stubs and scripts as they are
        if hidden:
            text = yaml.safe_dump(remaining, sort_keys=False, default_flow_style=None)
            (output / _CONFIG_NAME).write_text(_REWRITTEN_HEADER + text)
        readme = output / "README.md"
        if readme.is_file():
            readme.write_text(student_readme(readme.read_text()))
    except OSError as err:
        raise ConfigError(f"cannot write the release into {output}: {err.strerror}") from err
    load_config(output / _CONFIG_NAME)  # the release must grade: its configuration must load
    return Release(output, tuple(sorted(hidden)), tuple(sorted(partly)), tuple(private))


_INSTRUCTORS = "\n## For instructors and TAs"


def student_readme(text: str) -> str:
    """The README students get: what the course is and their commands, without the part
    for instructors and TAs (deploying, batch grading, developing the grader)."""
    return text.split(_INSTRUCTORS, 1)[0].rstrip() + "\n"


def _used_by(folder: Path, names: set[str], files: set[str]) -> set[str]:
    """``names`` of ``files`` (paths from ``folder``), and whatever of ``files`` they use:
    the modules of the folder they import and the files they name in a string, in turn."""
    by_name: dict[str, set[str]] = {}
    for name in files:
        by_name.setdefault(Path(name).name, set()).add(name)
    used, todo = set(), [n for n in names if n in files]
    while todo:
        name = todo.pop()
        if name in used:
            continue
        used.add(name)
        if name.endswith(".py"):
            for word in _words(folder / name):
                todo += by_name.get(word, set()) | ({word} & files)
    return used


def _words(file: Path) -> set[str]:
    """What a Python file names: its string constants, and its imports as the paths of
    the files they would load (``a.b``: ``a/b.py``, ``a/b/__init__.py``, ``a/__init__.py``)."""
    words: set[str] = set()
    for node in ast.walk(_parse(file)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            words.add(node.value)
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            modules = [base, *(f"{base}.{a.name}".lstrip(".") for a in node.names)]
        for module in filter(None, modules):
            parts = module.split(".")
            words |= {"/".join(parts[:i]) + "/__init__.py" for i in range(1, len(parts) + 1)}
            words.add("/".join(parts) + ".py")
    return words


def _parse(file: Path) -> ast.Module:
    try:
        return ast.parse(file.read_text(), str(file))
    except (OSError, SyntaxError, ValueError) as err:
        raise ConfigError(f"cannot read the graded test file {file}: {err}") from err


def _test_names(file: Path) -> set[str]:
    """The graded test names (``test_`` dropped, as in grading.yaml) a test file defines.

    Read from the source, not collected with pytest: collection imports the
    file, and a file that does not import must still be released or left out.
    """
    tree = _parse(file)
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    nodes = [n for n in tree.body if isinstance(n, functions)]
    for klass in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        if klass.name.startswith("Test"):
            nodes += [n for n in klass.body if isinstance(n, functions)]
    return {n.name.removeprefix("test_") for n in nodes if n.name.startswith("test_")}


def _hidden_files(config: GradingConfig) -> tuple[set[str], set[str]]:
    """The graded test files whose every test is hidden, and those with some hidden.

    Each as its path relative to the configuration's folder, as ``file:`` names it.
    """
    hidden: set[str] = set()
    partly: set[str] = set()
    for part in config.parts.values():
        for file in part.files:
            names = _test_names(file)
            # after_due_date and after_published tests are secret until then, too
            invisible = {n for n in names if not part.settings_for(n).visible}
            where = _relative(file, config)
            if names and invisible == names:
                hidden.add(where)
            elif invisible:
                partly.add(where)
    return hidden, partly


def _relative(file: Path, config: GradingConfig) -> str:
    return Path(os.path.relpath(file, config.path.parent)).as_posix()


def _config_without(config: GradingConfig, hidden: set[str]) -> dict[str, Any]:
    """``config``'s YAML without the ``hidden`` files, their parts or their tests' entries."""
    raw = yaml.safe_load(config.path.read_text())
    parts: dict[str, Any] = {}
    for name, body in raw["parts"].items():
        part = config.part(str(name))
        kept = [f for f in part.files if _relative(f, config) not in hidden]
        if not kept:
            continue
        if len(kept) < len(part.files):
            body = dict(body)
            names = [_relative(f, config) for f in kept]
            body["file"] = names if len(names) > 1 else names[0]
            defined = set().union(*(_test_names(f) for f in kept))
            tests = {t: v for t, v in (body.get("tests") or {}).items() if t in defined}
            body.pop("tests", None)
            if tests:
                body["tests"] = tests
        parts[name] = body
    return {**raw, "parts": parts}
