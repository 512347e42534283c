"""Fixtures of the graded tests. Each test runs on every rank of a torchrun job.

A graded test is an ordinary pytest function marked with what it grades::

    @pytest.mark.graded(target="collectives.all_reduce", kind="correctness")
    def test_all_reduce(student, rank, world_size): ...

Its points, world sizes and time limits come from ``grading.yaml``. It fails
with an ``AssertionError`` whose message is the first thing a student should
fix; the grader reports it with the rank it happened on.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
import torch

from grader.rank import context
from grader.rank.context import TestContext


@pytest.fixture
def ctx() -> TestContext:
    return context.current()


@pytest.fixture
def rank(ctx: TestContext) -> int:
    return ctx.rank


@pytest.fixture
def world_size(ctx: TestContext) -> int:
    return ctx.world_size


@pytest.fixture
def device(ctx: TestContext) -> torch.device:
    return ctx.device


@pytest.fixture
def options(ctx: TestContext) -> dict[str, Any]:
    """The test's ``options`` from grading.yaml (thresholds, sizes)."""
    return ctx.options


@pytest.fixture
def student(ctx: TestContext) -> ModuleType:
    """The submission's module of this test's part, e.g. ``assignments.collectives``."""
    return ctx.load_student()


@pytest.fixture
def reference(ctx: TestContext) -> ModuleType:
    """The reference implementation of this test's part, e.g. ``reference.collectives``."""
    return ctx.load_reference()
