"""The ``options:`` of a graded test in grading.yaml, as one typed record checked when the
file loads (as pytest-timeout merges its settings once): a misspelt key or a ratio below 1
is one line before any job starts, not a KeyError in the middle of grading.

A part's ``options:`` are its tests' defaults; a test's own ``options:`` replace single
keys. A graded test reads them from its ``options`` fixture, e.g.
``options.communication_elements``; :meth:`TestOptions.need` names the test's option
that grading.yaml left out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from grader.dtypes import FLOATING


class OptionError(ValueError):
    """An option grading.yaml gives that is unknown or out of range; the message is one line."""


@dataclass(frozen=True)
class TestOptions:
    __test__ = False  # not a pytest test class, whatever its name

    communication_elements: int | None = None  # float32 elements of a communication test
    performance_elements: int | None = None  # float32 elements of a performance test
    full_points_within: float = 1.5  # full points within this ratio to the reference's time
    zero_points_beyond: float = 3.0  # and none beyond this one, linear between
    # Local work per call a performance test never charges beyond the reference's: the noise
    # of timing it on a busy machine (milliseconds; see grader/testkit/costs.py).
    local_allowance_ms: float = 20.0
    # Bytes over the bound that still earn the communication points: one ratio, or one per
    # function of the part (a function not named gets 1.0).
    max_bytes_ratio: float | Mapping[str, float] = 1.0
    backward_bytes_ratio: float | None = None  # ring attention's backward, over (p-1) blocks
    # The largest relative error a trained parameter may carry, per dtype name.
    tolerance: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def read(cls, raw: Any, base: TestOptions | None = None) -> TestOptions:
        """``base`` with the keys of ``raw`` (grading.yaml's mapping) on top, each checked."""
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise OptionError(f"options must be a mapping, got {raw!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(map(str, raw)) - known)
        if unknown:
            raise OptionError(
                f"unknown option {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        values = {key: _CHECKS[key](key, value) for key, value in raw.items()}
        options = dataclasses.replace(base or cls(), **values)
        if options.zero_points_beyond <= options.full_points_within:
            raise OptionError(
                f"zero_points_beyond ({options.zero_points_beyond:g}) must be above "
                f"full_points_within ({options.full_points_within:g})"
            )
        return options

    def need(self, name: str) -> Any:
        """Option ``name``, which this test cannot do without."""
        value = getattr(self, name)
        if value is None:
            raise OptionError(f"grading.yaml gives this test no '{name}' in its options")
        return value

    def tolerance_for(self, dtype: str) -> float:
        """``tolerance`` for ``dtype`` (a name such as ``float32``)."""
        if dtype not in self.tolerance:
            raise OptionError(f"grading.yaml gives this test no tolerance for {dtype}")
        return self.tolerance[dtype]

    def bytes_ratio(self, function: str) -> float:
        """``max_bytes_ratio`` for ``function``."""
        ratio = self.max_bytes_ratio
        return float(ratio.get(function, 1.0) if isinstance(ratio, Mapping) else ratio)


def _count(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OptionError(f"{key} must be a positive integer, got {value!r}")
    return value


def _ratio(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1:
        raise OptionError(f"{key} must be a number >= 1, got {value!r}")
    return float(value)


def _milliseconds(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise OptionError(f"{key} must be a number of milliseconds >= 0, got {value!r}")
    return float(value)


def _ratios(key: str, value: Any) -> float | dict[str, float]:
    if isinstance(value, Mapping):
        return {str(name): _ratio(f"{key}.{name}", ratio) for name, ratio in value.items()}
    return _ratio(key, value)


def _tolerances(key: str, value: Any) -> dict[str, float]:
    if not isinstance(value, Mapping):
        raise OptionError(f"{key} must map dtype names to numbers, got {value!r}")
    tolerances = {}
    for dtype, bound in value.items():
        if dtype not in FLOATING:
            raise OptionError(f"{key}: unknown dtype {dtype!r} (known: {', '.join(FLOATING)})")
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or bound <= 0:
            raise OptionError(f"{key}.{dtype} must be a positive number, got {bound!r}")
        tolerances[dtype] = float(bound)
    return tolerances


_CHECKS = {
    "communication_elements": _count,
    "performance_elements": _count,
    "local_allowance_ms": _milliseconds,
    "full_points_within": _ratio,
    "zero_points_beyond": _ratio,
    "max_bytes_ratio": _ratios,
    "backward_bytes_ratio": _ratio,
    "tolerance": _tolerances,
}
