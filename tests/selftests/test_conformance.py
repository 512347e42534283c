"""What passes on the broker works on real gloo, and what fails there fails here with the
same cause: every variant of ``submissions/conformance/variants.py`` (a call the student API
allows, with one argument form each) runs on 3 real gloo processes and through the grader's
broker, and the outcomes must agree (see :func:`conformance.disagreement`).

The rules where the grader is stricter than gloo on purpose are docs/conformance.md's.
"""

from __future__ import annotations

import sys

import pytest
from conformance import TABLE, Outcome, disagreement, on_broker, on_gloo

sys.path.insert(0, str(TABLE))
import variants

P = 3
NAMES = [v.name for v in variants.VARIANTS]


@pytest.fixture(scope="module")
def gloo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    outcomes = on_gloo(len(NAMES), P, tmp_path_factory.mktemp("gloo"))
    return dict(zip(NAMES, outcomes, strict=True))


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    return on_broker(NAMES, P, tmp_path_factory.mktemp("broker"))


def test_variant_names_are_unique() -> None:
    assert len(set(NAMES)) == len(NAMES), "two variants share a name"


@pytest.mark.parametrize("name", NAMES)
def test_broker_agrees_with_gloo(name: str, gloo: dict, broker: dict) -> None:
    problem = disagreement(variants.BY_NAME[name], gloo[name], broker[name])
    assert problem is None, f"{name}: {problem}"
