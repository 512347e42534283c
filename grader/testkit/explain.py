"""Comparing float64 results with a one-process oracle, and blaming the ranks that differ.

The strategy parts (data parallelism, the sharded optimizer) check every rank's result against
the same work done here in float64, within :data:`grader.tolerances.FLOAT64_ORACLE`; anything
within :data:`~grader.tolerances.FLOAT32` but not that is float32 arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from grader.testkit.compare import format_pair, rank_blame
from grader.tolerances import FLOAT32, FLOAT64_ORACLE, Tolerance


def close(got: Any, want: Tensor, tolerance: Tolerance = FLOAT64_ORACLE) -> bool:
    """``got`` is a tensor of ``want``'s shape within ``tolerance``."""
    return isinstance(got, Tensor) and got.shape == want.shape and tolerance.holds(got, want)


def close_in_float32(got: Any, want: Tensor) -> bool:
    """Within float32's precision of ``want`` (a float64 result computed in float32 somewhere)."""
    return close(got, want, FLOAT32)


def difference(got: Any, want: Tensor) -> str:
    """How ``got`` differs from ``want``: its shape, or the largest error and where it is.

    Six digits show most errors; values that agree to six digits (float32 rounding) are shown
    with as many more as it takes to tell them apart (:func:`compare.format_pair`).
    """
    if not isinstance(got, Tensor) or got.shape != want.shape:
        shape = tuple(got.shape) if isinstance(got, Tensor) else type(got).__name__
        return f"has shape {shape}, expected {tuple(want.shape)}"
    got, want = got.detach().double(), want.detach().double()
    error = (got - want).abs()
    at = tuple(int(i) for i in torch.unravel_index(error.argmax(), error.shape))
    expected, actual = format_pair(float(want[at]), float(got[at]))
    return (
        f"differs by {float(error.max()):.3g} (max abs; at {list(at)}: expected "
        f"{expected}, got {actual})"
    )


def uniform_factor(got: dict[str, Any], want: dict[str, Tensor]) -> float | None:
    """The factor c with got[n] == c * want[n] for every name, if there is one and it is not 1.

    A uniform factor is the signature of a wrong scaling (summed, averaged twice, a hard-coded
    divisor); the least-squares c is checked on every element before it is named.
    """
    if not want or not all(isinstance(got.get(n), Tensor) for n in want):
        return None
    dot = sum(float((got[n].double() * w.double()).sum()) for n, w in want.items())
    norm = sum(float((w.double() ** 2).sum()) for w in want.values())
    if norm == 0:
        return None
    factor = dot / norm
    if abs(factor - 1) < 1e-6 or not all(close(got[n], factor * w) for n, w in want.items()):
        return None
    return factor


def blame(what: str, problems: Sequence[str | None]) -> None:
    """Fail naming the first rank with a problem, the other ranks that share it, and the
    next rank with another."""
    wrong = {r: problem for r, problem in enumerate(problems) if problem}
    if wrong:
        raise AssertionError(rank_blame(wrong, prefix=f"{what}: ", others=True))
