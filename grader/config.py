"""The grading configuration: which parts exist, their world sizes, points and time limits.

It lives in YAML (``tests/graded/grading.yaml``) so that an instructor changes a
weight or a timeout without touching Python. Every value is checked here, once,
so that a typo is reported as one clear line (exit status 2) before any job starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
GRADED_DIR = REPO_ROOT / "tests" / "graded"
DEFAULT_CONFIG = GRADED_DIR / "grading.yaml"

# How every pytest run over the graded tests is configured, in the grader and on the ranks.
GRADED_PYTEST_ARGS = (
    f"--rootdir={GRADED_DIR}",
    "-c",
    str(GRADED_DIR / "pytest.ini"),
    "--import-mode=importlib",
    "-p",
    "no:cacheprovider",
)

VISIBILITIES = ("hidden", "after_due_date", "after_published", "visible")
KINDS = ("correctness", "performance", "communication", "schedule")


class ConfigError(Exception):
    """The configuration cannot be used; the message is one line for the user."""


@dataclass(frozen=True)
class TestSettings:
    """What the YAML says of one graded test (a part's defaults, overridden per test)."""

    world_sizes: tuple[int, ...]
    points: float
    timeout: float
    op_timeout: float
    visibility: str
    forbid_collectives: bool
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PartConfig:
    name: str
    files: tuple[Path, ...]
    defaults: TestSettings
    overrides: dict[str, dict[str, Any]]

    def settings_for(self, test_name: str) -> TestSettings:
        """The settings of one test: the part's defaults with the test's own keys on top."""
        raw = dict(self.overrides.get(test_name, {}))
        options = {**self.defaults.options, **raw.pop("options", {})}
        return _settings(raw, f"{self.name}.tests.{test_name}", base=self.defaults, options=options)


@dataclass(frozen=True)
class GradingConfig:
    parts: dict[str, PartConfig]
    path: Path

    def part(self, name: str) -> PartConfig:
        if name not in self.parts:
            known = ", ".join(self.parts)
            raise ConfigError(f"unknown part '{name}' (known parts: {known})")
        return self.parts[name]


_SETTING_KEYS = {
    "world_sizes",
    "points",
    "timeout",
    "op_timeout",
    "visibility",
    "forbid_collectives",
    "options",
}
_PART_KEYS = _SETTING_KEYS | {"file", "tests"}


def load_config(path: Path = DEFAULT_CONFIG) -> GradingConfig:
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read the grading configuration {path}: {err.strerror}") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {_first_line(err)}") from err
    if not isinstance(raw, dict) or not isinstance(raw.get("parts"), dict) or not raw["parts"]:
        raise ConfigError(f"{path}: expected a mapping 'parts' with at least one part")
    parts = {name: _part(str(name), body, path.parent, path) for name, body in raw["parts"].items()}
    return GradingConfig(parts=parts, path=path)


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
    settings = {k: v for k, v in body.items() if k in _SETTING_KEYS - {"options"}}
    defaults = _settings(settings, name, base=None, options=dict(body.get("options") or {}))
    overrides = body.get("tests") or {}
    if not isinstance(overrides, dict) or not all(isinstance(v, dict) for v in overrides.values()):
        raise ConfigError(f"{path}: part '{name}': 'tests' must map test names to mappings")
    for test, keys in overrides.items():
        bad = set(keys) - _SETTING_KEYS
        if bad:
            raise ConfigError(f"{path}: {name}.tests.{test}: unknown keys {', '.join(sorted(bad))}")
        _settings(dict(keys), f"{name}.tests.{test}", base=defaults, options={})
    return PartConfig(name=name, files=files, defaults=defaults, overrides=overrides)


def _settings(
    raw: dict[str, Any], where: str, base: TestSettings | None, options: dict[str, Any]
) -> TestSettings:
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
        op_timeout=_number(get("op_timeout", 10), where, "op_timeout", minimum=0.1),
        visibility=str(get("visibility", "visible")),
        forbid_collectives=bool(get("forbid_collectives", False)),
        options=options,
    )
    if settings.visibility not in VISIBILITIES:
        raise ConfigError(f"{where}: visibility must be one of {', '.join(VISIBILITIES)}")
    return settings


def _number(value: Any, where: str, key: str, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise ConfigError(f"{where}: {key} must be a number >= {minimum}, got {value!r}")
    return float(value)


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
