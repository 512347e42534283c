"""The graded tests there are: collected with pytest, weighted with the YAML.

Collection happens once, in the supervising process, before any job starts,
so that every test of every selected part is known (and will be reported)
whatever the submission later does.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from grader.course import config as course
from grader.course.config import KINDS, ConfigError, GradingConfig, TestSettings

_AUTOLOAD = "PYTEST_DISABLE_PLUGIN_AUTOLOAD"


@dataclass(frozen=True)
class GradedTest:
    """One graded test function (or parametrization) at one world size: one results entry."""

    part: str
    name: str  # e.g. "all_reduce" or "all_reduce[large]"
    nodeid: str  # relative to tests/graded
    target: str
    kind: str
    world_size: int
    settings: TestSettings

    @property
    def id(self) -> str:
        return f"{self.part}::{self.name}::ws{self.world_size}"

    @property
    def title(self) -> str:
        return f"{self.part}: {self.name} (world size {self.world_size})"


@contextlib.contextmanager
def graded_pytest() -> Iterator[None]:
    """A pytest run of the graded tests: no third-party plugin (one would write files into
    the user's directory, or change how tests run), and pytest's output kept off the terminal."""
    previous = os.environ.get(_AUTOLOAD)
    os.environ[_AUTOLOAD] = "1"
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        if previous is None:
            del os.environ[_AUTOLOAD]
        else:
            os.environ[_AUTOLOAD] = previous


class WorldSizes:
    """Runs every graded test once per world size that grading.yaml gives it.

    The sizes are a parameter, ``world_size``, of every test that asks for it
    (through the ``world`` fixture): the same node ids in collection and in grading.
    """

    def __init__(self, config: GradingConfig) -> None:
        self.config = config
        self.part_of = {f.name: p for p in config.parts for f in config.part(p).files}

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "world_size" not in metafunc.fixturenames:
            return
        part = self.part_of.get(metafunc.definition.path.name)
        if part is None:
            return
        name = metafunc.definition.originalname.removeprefix("test_")
        sizes = self.config.part(part).settings_for(name).world_sizes
        metafunc.parametrize("world_size", sizes, ids=[f"ws{n}" for n in sizes])


@dataclass(frozen=True)
class _Item:
    nodeid: str
    name: str
    world_size: int | None
    marker: dict[str, Any] | None


class _Collector:
    def __init__(self) -> None:
        self.items: list[_Item] = []
        self.errors: list[str] = []

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            marker = item.get_closest_marker("graded")
            kwargs = dict(marker.kwargs) if marker else None
            params = dict(getattr(getattr(item, "callspec", None), "params", {}))
            world_size = params.pop("world_size", None)
            if kwargs and "target" in kwargs and params:
                # A parametrized test may name its target after its parameters:
                # target="collectives.{function}".
                kwargs["target"] = kwargs["target"].format(**params)
            base = getattr(item, "originalname", item.name)
            name = f"{base}[{'-'.join(map(str, params.values()))}]" if params else base
            self.items.append(_Item(item.nodeid, name, world_size, kwargs))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.errors.append(f"{report.nodeid}: {report.longreprtext.strip().splitlines()[-1]}")


def collect(config: GradingConfig, parts: list[str]) -> list[GradedTest]:
    """Every graded test of ``parts``, each at every world size it runs at."""
    collector = _Collector()
    files = [str(f) for p in parts for f in config.part(p).files]
    plugins = [collector, WorldSizes(config)]
    with graded_pytest():
        pytest.main([*files, "--collect-only", "-q", *course.GRADED_PYTEST_ARGS], plugins=plugins)
    if collector.errors:
        raise ConfigError("cannot collect the graded tests: " + "; ".join(collector.errors))
    file_to_part = {f.name: p for p in parts for f in config.part(p).files}
    tests = []
    for item in collector.items:
        part = file_to_part.get(item.nodeid.split("::")[0])
        if part is None:
            continue
        marker = item.marker
        if marker is None or "target" not in marker or item.world_size is None:
            raise ConfigError(
                f"graded test {item.nodeid} needs @pytest.mark.graded(target=..., kind=...) "
                "and the world fixture"
            )
        kind = marker.get("kind", "correctness")
        if kind not in KINDS:
            raise ConfigError(f"graded test {item.nodeid}: kind must be one of {', '.join(KINDS)}")
        name = item.name.removeprefix("test_")
        settings = config.part(part).settings_for(name.split("[")[0])
        tests.append(
            GradedTest(part, name, item.nodeid, marker["target"], kind, item.world_size, settings)
        )
    _check_overrides_exist(config, parts, tests)
    return tests


def _check_overrides_exist(
    config: GradingConfig, parts: list[str], tests: list[GradedTest]
) -> None:
    names = {(t.part, t.name.split("[")[0]) for t in tests}
    for part in parts:
        for name in config.part(part).overrides:
            if (part, name) not in names:
                raise ConfigError(
                    f"{config.path.name}: {part}.tests.{name} names no graded test "
                    f"(there is no test_{name} in "
                    f"{', '.join(f.name for f in config.part(part).files)})"
                )
