"""The grading configuration: which parts exist, their world sizes, points and time limits.

It lives in YAML (``tests/graded/grading.yaml``) so that an instructor changes a
weight or a timeout without touching Python. Every value is checked here, once,
so that a typo is reported as one clear line (exit status 2) before any job starts.

The course directory (the one holding ``tests/graded/``, ``assignments/`` and
``reference/``) is not necessarily where the package is: after ``pip install .``
the package lives in site-packages. So the configuration is found by
:func:`find_config` and made current by :func:`activate`, which also exports it
in ``GRADER_CONFIG`` so that a process the grader starts with the course at
hand (``grader bench``'s ranks, which import the reference) finds the same one.
The ranks of a graded job never read it: they see no course at all.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from grader.course.options import OptionError, TestOptions
from grader.sandbox import DEFAULT_MEMORY, DEFAULT_SCRATCH, MiB

CONFIG_ENV = "GRADER_CONFIG"
RELATIVE_CONFIG = Path("tests") / "graded" / "grading.yaml"
_PACKAGE_CHECKOUT = Path(__file__).resolve().parents[2]


class ConfigError(Exception):
    """The configuration cannot be used; the message is one line for the user."""


def find_config(explicit: Path | None = None, cwd: Path | None = None) -> Path:
    """The grading configuration to use, by the documented order (docs/commands.md).

    ``--config FILE``, else ``$GRADER_CONFIG``, else the nearest
    ``tests/graded/grading.yaml`` from the current directory upward, else the
    one next to the package (a checkout or an editable install).
    """
    if explicit is not None:
        return explicit.expanduser().resolve()
    if os.environ.get(CONFIG_ENV):
        return Path(os.environ[CONFIG_ENV]).expanduser().resolve()
    here = (cwd or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / RELATIVE_CONFIG).is_file():
            return folder / RELATIVE_CONFIG
    if (_PACKAGE_CHECKOUT / RELATIVE_CONFIG).is_file():
        return _PACKAGE_CHECKOUT / RELATIVE_CONFIG
    raise ConfigError(
        "cannot find the grading configuration: run grader inside the course directory "
        f"(the one holding {RELATIVE_CONFIG}), or name it with --config FILE or {CONFIG_ENV}"
    )


def course_root(config: Path) -> Path:
    """The course directory of a configuration: where ``assignments/`` and ``reference/`` are.

    The folder above ``tests/graded/``; for a configuration kept elsewhere, the
    nearest folder above it that holds ``assignments/``, else its own folder.
    """
    graded = config.parent
    if graded.name == "graded" and graded.parent.name == "tests":
        return graded.parent.parent
    for folder in graded.parents:
        if (folder / "assignments").is_dir():
            return folder
    return graded


def activate(config: Path) -> None:
    """Make ``config`` the current configuration, here and in every process started later.

    Modules that need the course's paths read them from this module at call
    time, after the command line has chosen the configuration.
    """
    global REPO_ROOT, GRADED_DIR, DEFAULT_CONFIG, GRADED_PYTEST_ARGS
    DEFAULT_CONFIG = config.resolve()
    GRADED_DIR = DEFAULT_CONFIG.parent
    REPO_ROOT = course_root(DEFAULT_CONFIG)
    GRADED_PYTEST_ARGS = _pytest_args(GRADED_DIR)
    os.environ[CONFIG_ENV] = str(DEFAULT_CONFIG)


def _pytest_args(graded_dir: Path) -> tuple[str, ...]:
    """How the grader's pytest runs over the graded tests are configured (``grader list``
    collects them, ``grader run`` runs them), both in the grader's own process."""
    return (
        f"--rootdir={graded_dir}",
        "-c",
        str(graded_dir / "pytest.ini"),
        "--import-mode=importlib",
        "-p",
        "no:cacheprovider",
        # A failed assert's message is the student's message, as the test wrote it.
        "--assert=plain",
        # Its end of session runs five full garbage collections (half a second in the
        # grader's process, which holds torch) to report warnings no verdict reads.
        "-p",
        "no:unraisableexception",
    )


def _initial_config() -> Path:
    """The configuration found when this module is imported, without raising: a process
    the grader started finds it in ``GRADER_CONFIG``; a missing one is reported when it
    is loaded."""
    try:
        return find_config()
    except (ConfigError, OSError):
        return _PACKAGE_CHECKOUT / RELATIVE_CONFIG


DEFAULT_CONFIG = _initial_config()
GRADED_DIR = DEFAULT_CONFIG.parent
REPO_ROOT = course_root(DEFAULT_CONFIG)
GRADED_PYTEST_ARGS = _pytest_args(GRADED_DIR)

VISIBLE = "visible"  # shown to students at once; the others later or never
VISIBILITIES = ("hidden", "after_due_date", "after_published", VISIBLE)
# What a graded test checks: its result, or one of the costs (in the order a summary shows
# them: the bytes, the time, the schedule), which earn points only on a correct result.
COST_KINDS = ("communication", "performance", "schedule")
KINDS = ("correctness", *COST_KINDS)
TIMED = "performance"  # the kind timed against the reference's own job, in the same run
# Gradescope's top-level keys a ``gradescope:`` block may set, each a visibility.
GRADESCOPE_KEYS = ("visibility", "stdout_visibility")


@dataclass(frozen=True)
class TestSettings:
    """What the YAML says of one graded test (a part's defaults, overridden per test)."""

    __test__ = False  # not a pytest test class, whatever its name

    world_sizes: tuple[int, ...]
    points: float
    timeout: float
    visibility: str
    forbid_collectives: bool
    options: TestOptions = field(default_factory=TestOptions)
    # Every world size must divide this (tests that shard fixed dimensions across ranks).
    world_sizes_divide: int | None = None

    @property
    def visible(self) -> bool:
        """Shown to students as soon as they are graded."""
        return self.visibility == VISIBLE


@dataclass(frozen=True)
class PartConfig:
    name: str
    files: tuple[Path, ...]
    defaults: TestSettings
    overrides: dict[str, dict[str, Any]]

    def settings_for(self, test_name: str) -> TestSettings:
        """The settings of one test: the part's defaults with the test's own keys on top."""
        raw = dict(self.overrides.get(test_name, {}))
        return _settings(raw, f"{self.name}.tests.{test_name}", base=self.defaults)

    def largest_world_size(self) -> int:
        """The largest world size any test of the part is graded at (known before the tests
        are collected: a job of that many ranks can start meanwhile)."""
        named = (self.settings_for(name) for name in self.overrides)
        return max(max(s.world_sizes) for s in (self.defaults, *named))


#: The ``limits:`` block: what each rank may use, in MiB (defaults: grader.sandbox's).
LIMIT_KEYS = ("memory_per_rank_mib", "scratch_per_rank_mib")


@dataclass(frozen=True)
class RankLimits:
    """What one rank may use (``limits:`` in grading.yaml); a rank past one is the
    student's fault, told with the limit's name."""

    memory_bytes: int = DEFAULT_MEMORY
    scratch_bytes: int = DEFAULT_SCRATCH


@dataclass(frozen=True)
class GradingConfig:
    parts: dict[str, PartConfig]
    path: Path
    # Gradescope's top-level keys (GRADESCOPE_KEYS) to write into results.json.
    gradescope: dict[str, str] = field(default_factory=dict)
    limits: RankLimits = field(default_factory=RankLimits)

    def part(self, name: str) -> PartConfig:
        if name not in self.parts:
            known = ", ".join(self.parts)
            raise ConfigError(f"unknown part '{name}' (known parts: {known})")
        return self.parts[name]


_SETTING_KEYS = {
    "world_sizes",
    "points",
    "timeout",
    "visibility",
    "forbid_collectives",
    "options",
    "world_sizes_divide",
}
_PART_KEYS = _SETTING_KEYS | {"file", "tests"}


def load_config(path: Path | None = None) -> GradingConfig:
    """Read and check the configuration (default: the current one, see :func:`activate`)."""
    path = DEFAULT_CONFIG if path is None else path
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read the grading configuration {path}: {err.strerror}") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {_first_line(err)}") from err
    if not isinstance(raw, dict) or not isinstance(raw.get("parts"), dict) or not raw["parts"]:
        raise ConfigError(f"{path}: expected a mapping 'parts' with at least one part")
    parts = {name: _part(str(name), body, path.parent, path) for name, body in raw["parts"].items()}
    gradescope = _gradescope(raw.get("gradescope"), parts, path)
    limits = _limits(raw.get("limits"), path)
    return GradingConfig(parts=parts, path=path, gradescope=gradescope, limits=limits)


def _block(body: Any, name: str, keys: Sequence[str], path: Path) -> None:
    """A top-level block of grading.yaml is a mapping of known keys, or one clear line."""
    if not isinstance(body, dict):
        raise ConfigError(f"{path}: '{name}' must be a mapping")
    unknown = set(body) - set(keys)
    if unknown:
        raise ConfigError(
            f"{path}: {name} has unknown keys: {', '.join(sorted(map(str, unknown)))} "
            f"(known: {', '.join(keys)})"
        )


def _limits(body: Any, path: Path) -> RankLimits:
    """The ``limits:`` block, in whole MiB (at least 16 each)."""
    if body is None:
        return RankLimits()
    _block(body, "limits", LIMIT_KEYS, path)
    for key, value in body.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 16:
            raise ConfigError(f"{path}: limits.{key} must be a whole number of MiB >= 16")
    defaults = RankLimits()
    return RankLimits(
        memory_bytes=body.get("memory_per_rank_mib", defaults.memory_bytes // MiB) * MiB,
        scratch_bytes=body.get("scratch_per_rank_mib", defaults.scratch_bytes // MiB) * MiB,
    )


def _gradescope(body: Any, parts: dict[str, PartConfig], path: Path) -> dict[str, str]:
    """The ``gradescope:`` block: Gradescope's top-level visibilities, checked.

    The grader's own output lists every test by name, so showing it to students
    (``stdout_visibility: visible``) would reveal the tests meant to stay hidden.
    """
    if body is None:
        return {}
    _block(body, "gradescope", GRADESCOPE_KEYS, path)
    for key, value in body.items():
        if value not in VISIBILITIES:
            raise ConfigError(
                f"{path}: gradescope.{key} must be one of {', '.join(VISIBILITIES)}, got {value!r}"
            )
    if body.get("stdout_visibility") == VISIBLE:
        for part in parts.values():
            hidden = [
                name
                for name in (None, *part.overrides)
                if not (part.settings_for(name) if name else part.defaults).visible
            ]
            if hidden:
                which = f"{part.name}.tests.{hidden[0]}" if hidden[0] else part.name
                raise ConfigError(
                    f"{path}: gradescope.stdout_visibility: visible would show students the "
                    f"names of tests that are not visible ({which})"
                )
    return dict(body)


def _part(name: str, body: Any, base_dir: Path, path: Path) -> PartConfig:
    if not isinstance(body, dict):
        raise ConfigError(f"{path}: part '{name}' must be a mapping")
    unknown = set(body) - _PART_KEYS
    if unknown:
        raise ConfigError(f"{path}: part '{name}' has unknown keys: {', '.join(sorted(unknown))}")
    if "file" not in body:
        raise ConfigError(f"{path}: part '{name}' needs a 'file' (or a list of files)")
    names = body["file"] if isinstance(body["file"], list) else [body["file"]]
    files = tuple(base_dir / str(n) for n in names)
    for file in files:
        if not file.is_file():
            raise ConfigError(f"{path}: part '{name}': test file {file} does not exist")
    settings = {k: v for k, v in body.items() if k in _SETTING_KEYS}
    defaults = _settings(settings, name, base=None)
    overrides = body.get("tests") or {}
    if not isinstance(overrides, dict) or not all(isinstance(v, dict) for v in overrides.values()):
        raise ConfigError(f"{path}: part '{name}': 'tests' must map test names to mappings")
    for test, keys in overrides.items():
        bad = set(keys) - _SETTING_KEYS
        if bad:
            raise ConfigError(f"{path}: {name}.tests.{test}: unknown keys {', '.join(sorted(bad))}")
        _settings(dict(keys), f"{name}.tests.{test}", base=defaults)
    return PartConfig(name=name, files=files, defaults=defaults, overrides=overrides)


def _settings(raw: dict[str, Any], where: str, base: TestSettings | None) -> TestSettings:
    def get(key: str, default: Any) -> Any:
        if key in raw:
            return raw[key]
        if base is not None:
            return getattr(base, key)
        if default is None:
            raise ConfigError(f"{where}: missing '{key}'")
        return default

    world_sizes = get("world_sizes", None)
    if (
        not isinstance(world_sizes, (list, tuple))
        or not world_sizes
        or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in world_sizes)
    ):
        raise ConfigError(f"{where}: world_sizes must be a list of positive integers")
    settings = TestSettings(
        world_sizes=tuple(world_sizes),
        points=_number(get("points", 1), where, "points", minimum=0),
        timeout=_number(get("timeout", 60), where, "timeout", minimum=0.1),
        visibility=str(get("visibility", VISIBLE)),
        forbid_collectives=bool(get("forbid_collectives", False)),
        options=_options(raw.get("options"), where, base),
        world_sizes_divide=_divisor(get("world_sizes_divide", 0), where),
    )
    if settings.visibility not in VISIBILITIES:
        raise ConfigError(f"{where}: visibility must be one of {', '.join(VISIBILITIES)}")
    for size in settings.world_sizes:
        if settings.world_sizes_divide and settings.world_sizes_divide % size:
            raise ConfigError(
                f"{where}: world size {size} cannot be used: these tests shard dimensions "
                f"that must divide by the world size, and {size} does not divide "
                f"{settings.world_sizes_divide} (world_sizes_divide: {settings.world_sizes_divide})"
            )
    return settings


def _divisor(value: Any, where: str) -> int | None:
    """``world_sizes_divide``: a positive integer, or absent (0 or None: no constraint)."""
    if value is None or value == 0:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: world_sizes_divide must be a positive integer, got {value!r}")
    return value


def _options(raw: Any, where: str, base: TestSettings | None) -> TestOptions:
    """The test's options: the part's, with the test's own keys on top."""
    try:
        return TestOptions.read(raw, base.options if base is not None else None)
    except OptionError as err:
        raise ConfigError(f"{where}: {err}") from None


def _number(value: Any, where: str, key: str, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise ConfigError(f"{where}: {key} must be a number >= {minimum}, got {value!r}")
    return float(value)


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
