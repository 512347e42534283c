"""The graded tests there are: collected with pytest, weighted with the YAML.

Collection happens once, in the supervising process, before any job starts,
so that every test of every selected part is known (and will be reported)
whatever the submission later does.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from typing import Any

import pytest

from grader.config import GRADED_PYTEST_ARGS, KINDS, ConfigError, GradingConfig, TestSettings


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


class _Collector:
    def __init__(self) -> None:
        self.items: list[tuple[str, str, dict[str, Any] | None]] = []
        self.errors: list[str] = []

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            marker = item.get_closest_marker("graded")
            kwargs = dict(marker.kwargs) if marker else None
            params = getattr(getattr(item, "callspec", None), "params", {})
            if kwargs and "target" in kwargs and params:
                # A parametrized test may name its target after its parameters:
                # target="collectives.{function}".
                kwargs["target"] = kwargs["target"].format(**params)
            self.items.append((item.nodeid, item.name, kwargs))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.errors.append(f"{report.nodeid}: {report.longreprtext.strip().splitlines()[-1]}")


def collect(config: GradingConfig, parts: list[str]) -> list[GradedTest]:
    """Every graded test of ``parts``, each at every world size it runs at."""
    collector = _Collector()
    files = [str(f) for p in parts for f in config.part(p).files]
    with contextlib.redirect_stdout(io.StringIO()):
        pytest.main([*files, "--collect-only", "-q", *GRADED_PYTEST_ARGS], plugins=[collector])
    if collector.errors:
        raise ConfigError("cannot collect the graded tests: " + "; ".join(collector.errors))
    file_to_part = {f.name: p for p in parts for f in config.part(p).files}
    tests = []
    for nodeid, item_name, marker in collector.items:
        part = file_to_part.get(nodeid.split("::")[0])
        if part is None:
            continue
        if marker is None or "target" not in marker:
            raise ConfigError(
                f"graded test {nodeid} lacks @pytest.mark.graded(target=..., kind=...)"
            )
        kind = marker.get("kind", "correctness")
        if kind not in KINDS:
            raise ConfigError(f"graded test {nodeid}: kind must be one of {', '.join(KINDS)}")
        name = item_name.removeprefix("test_")
        base_name = name.split("[")[0]
        settings = config.part(part).settings_for(base_name)
        for world_size in settings.world_sizes:
            tests.append(
                GradedTest(part, name, nodeid, marker["target"], kind, world_size, settings)
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
