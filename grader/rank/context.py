"""What a graded test may know about the test it is: its rank, part, options, and its record.

The harness fills one :class:`TestContext` per test; the graded tests reach it
through the fixtures of ``tests/graded/conftest.py``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from grader.protocol import PlannedTest, ReportWriter
from grader.rank.accounting import CommLog, recording
from grader.rank.frames import display_path, student_frames


class SubmissionImportError(Exception):
    """The student's module could not be imported; the message says why, in one line."""


@dataclass
class TestContext:
    test: PlannedTest
    rank: int
    world_size: int
    device: torch.device
    report: ReportWriter
    barrier: Callable[[], None] = lambda: None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def options(self) -> dict[str, Any]:
        return self.test.options

    def load_student(self, part: str | None = None) -> ModuleType:
        """Import ``assignments.<part>``, turning any failure into one clear line."""
        module = f"assignments.{part or self.test.part}"
        self.report.write("importing", test=self.test.id, module=module)
        try:
            loaded = importlib.import_module(module)
        except SyntaxError as err:
            where = f"{display_path(err.filename or '?')}, line {err.lineno}"
            raise SubmissionImportError(
                f"{module} has a syntax error ({where}): {err.msg}"
            ) from None
        except Exception as err:
            raise SubmissionImportError(
                f"{module} could not be imported: {type(err).__name__}: {err}{_where(err)}"
            ) from None
        except SystemExit as err:
            raise SubmissionImportError(
                f"{module} called sys.exit({err.code!r}) while being imported"
            ) from None
        self.report.write("imported", test=self.test.id, module=module)
        return loaded

    def recording(self) -> AbstractContextManager[CommLog]:
        """Log every message and collective call made inside the ``with`` block."""
        return recording()

    def load_reference(self, part: str | None = None) -> ModuleType:
        return importlib.import_module(f"reference.{part or self.test.part}")


def _where(err: BaseException) -> str:
    frames = student_frames(err.__traceback__)
    return f" ({frames[-1]})" if frames else ""


_current: TestContext | None = None


def current() -> TestContext:
    if _current is None:
        raise RuntimeError("no graded test is running: run graded tests with `grader run`")
    return _current


def set_current(context: TestContext | None) -> None:
    global _current
    _current = context
    # A failed import leaves nothing behind, so that the next test tries (and reports) again.
    for name in [m for m in sys.modules if m.startswith("assignments.")]:
        if sys.modules[name] is None:
            del sys.modules[name]
