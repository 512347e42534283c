"""``grader release OUT``: the repository students get, written from the course directory.

What is shipped is an allow-list (:data:`RELEASED`), so that whatever an
instructor adds to the course directory stays private until it is named here:
``reference/``, ``tests/selftests`` (its broken submissions are near-solutions),
``deploy/``, ``.github/``, ``gradescope/``, the benchmarks (they run the
reference), ``.git``, caches, results and build outputs are never copied. The
files are chosen as the Gradescope zip chooses them
(:func:`grader.gradescope.course_files`); the grader's data (the reference's
message patterns, the machine models) travels inside ``grader/``, so the
release grades the cost tests as the course does, without a reference.

A graded test file whose every test is hidden from students before grading
(``hidden``, ``after_due_date`` or ``after_published`` in ``grading.yaml``:
anything but ``visible``) is left out, and the configuration is rewritten
without it, so that the release's own ``grading.yaml`` loads. A file with some
hidden tests is shipped whole (a file cannot be split):
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

from grader.config import ConfigError, GradingConfig, load_config
from grader.gradescope import course_files

# Top-level files and folders of the course directory that students get (with tests/graded/).
RELEASED = ("pyproject.toml", "README.md", "LICENSE", ".gitignore", "grader", "assignments", "docs")
_CONFIG_NAME = "tests/graded/grading.yaml"
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


def build_release(config: GradingConfig, output: Path) -> Release:
    """Write the student release of ``config``'s course into ``output`` (absent or empty).

    A folder that holds anything is refused rather than merged into: what was
    there would ship with the release, or be overwritten.
    """
    output = output.expanduser().resolve()
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ConfigError(f"cannot release into {output}: it exists and is not an empty folder")
    hidden, partly = _hidden_files(config)
    dropped = {f"tests/graded/{name}" for name in hidden}
    entries = [
        (file, name)
        for file, name in course_files(config, RELEASED, output)
        if name not in dropped and not (hidden and name == _CONFIG_NAME)
    ]
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
    except OSError as err:
        raise ConfigError(f"cannot write the release into {output}: {err.strerror}") from err
    load_config(output / _CONFIG_NAME)  # the release must grade: its configuration must load
    return Release(output, tuple(sorted(hidden)), tuple(sorted(partly)))


def _test_names(file: Path) -> set[str]:
    """The graded test names (``test_`` dropped, as in grading.yaml) a test file defines.

    Read from the source, not collected with pytest: collection imports the
    file, and a file that does not import must still be released or left out.
    """
    try:
        tree = ast.parse(file.read_text(), str(file))
    except (OSError, SyntaxError, ValueError) as err:
        raise ConfigError(f"cannot read the graded test file {file}: {err}") from err
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
            invisible = {n for n in names if part.settings_for(n).visibility != "visible"}
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
