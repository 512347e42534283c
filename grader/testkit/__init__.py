"""Helpers for writing graded tests: seeded per-rank data and comparisons that explain."""

from grader.testkit.compare import check_close, check_unchanged
from grader.testkit.data import rank_tensor

__all__ = ["check_close", "check_unchanged", "rank_tensor"]
