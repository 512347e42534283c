"""Every "close enough" of the grader, by name: one owner for the rule, read by the tests,
the testkit and the broker.

A :class:`Tolerance` bounds ``|got - want|`` by ``relative * (floor + |want|)``. A sum in
another order in float64 agrees to ~1e-15, so the float64 oracle leaves no bug unseen;
float32 is the error of float32 arithmetic somewhere on the way (a bucket, a cast); the
broker's gate accepts a float32 bucket's sum of float32 gradients. A result in its own
dtype is held to the rounding of an honest sum, element by element
(:func:`grader.testkit.compare.tolerance`, ``ROUNDING_ULPS`` units in the last place per term).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROUNDING_ULPS = 4.0


@dataclass(frozen=True)
class Tolerance:
    """A named rule for "close enough": ``|got - want| <= relative * (floor + |want|)``."""

    name: str
    relative: float
    floor: float = 1.0

    def bound(self, want: torch.Tensor | float) -> torch.Tensor | float:
        return self.relative * (self.floor + abs(want))

    def holds(self, got: torch.Tensor | float, want: torch.Tensor | float) -> bool:
        """Every element of ``got`` (of ``want``'s shape) within the bound; NaN never is."""
        if not isinstance(want, torch.Tensor):
            return abs(float(got) - want) <= self.bound(want)
        want = want.detach().double()
        return bool(((got.detach().double() - want).abs() <= self.bound(want)).all())


EXACT = Tolerance("exact", 0.0, 0.0)
FLOAT64_ORACLE = Tolerance("float64 oracle", 1e-9)
FLOAT32 = Tolerance("float32", 1e-5)
FLOAT32_BUCKET = Tolerance("float32 bucket", 1e-5, floor=1e-7)
# A float32 scalar (a mean loss) against its float64 value, and float32 layers (a stage's
# gradient, a partial sum of a matrix product) against theirs: several roundings deep.
FLOAT32_SCALAR = Tolerance("float32 scalar", 1e-5, floor=1e-2)
FLOAT32_LAYERS = Tolerance("float32 layers", 1e-4, floor=1e-3)
FLOAT32_PRODUCT = Tolerance("float32 product", 1e-4, floor=0.1)
POLICIES = {
    t.name: t
    for t in (
        EXACT,
        FLOAT64_ORACLE,
        FLOAT32,
        FLOAT32_BUCKET,
        FLOAT32_SCALAR,
        FLOAT32_LAYERS,
        FLOAT32_PRODUCT,
    )
}
