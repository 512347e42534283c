"""Comparing a student's tensor with the expected one, and saying what went wrong.

A bare "tensors differ" teaches nothing. :func:`check_close` finds the first
wrong element and tries the usual mistakes on it: a rank's contribution
missing or counted twice, another rank's data in place of the right one, the
tensor never written. The graded tests pass those candidate explanations in,
since only they know what each rank contributed.
"""

from __future__ import annotations

import torch

FLOAT_TOLERANCE_ULPS = 4.0


def tolerance(
    dtype: torch.dtype, magnitude: torch.Tensor | float, terms: int
) -> torch.Tensor | float:
    """How far an honest sum of ``terms`` values may land from ours in floating point.

    Any summation order is fair: the error of a sum of p terms is bounded by
    (p - 1) * eps * sum(|x_i|) (Higham, "Accuracy and Stability of Numerical
    Algorithms", 2002, section 4.2). Integers are compared exactly.
    """
    if not dtype.is_floating_point:
        return 0.0
    eps = torch.finfo(dtype).eps
    return FLOAT_TOLERANCE_ULPS * max(terms, 1) * eps * magnitude + torch.finfo(dtype).tiny


def check_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    what: str,
    *,
    magnitude: torch.Tensor | None = None,
    terms: int = 1,
    explanations: dict[str, torch.Tensor] | None = None,
    before: torch.Tensor | None = None,
) -> None:
    """Raise an AssertionError naming the first wrong element of ``actual``, and why.

    ``magnitude``: the sum of the absolute values of the terms behind each
    expected element (for the float tolerance); ``explanations``: what the
    tensor would hold after each usual mistake, by a phrase describing it;
    ``before``: the tensor's contents before the call (to recognise "not written").
    """
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{what}: expected shape {tuple(expected.shape)}, got {tuple(actual.shape)}"
        )
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{what}: expected dtype {expected.dtype}, got {actual.dtype}")
    got = actual.detach().cpu().reshape(-1).double()
    want = expected.detach().cpu().reshape(-1).double()
    scale = magnitude.detach().cpu().reshape(-1).double() if magnitude is not None else want.abs()
    allowed = tolerance(expected.dtype, scale, terms)
    wrong = ~((got - want).abs() <= allowed)  # NaN counts as wrong
    if not bool(wrong.any()):
        return
    index = int(wrong.nonzero()[0])
    count = int(wrong.sum())
    more = f" (and {count - 1} more of {got.numel()})" if count > 1 else ""
    position = _position(index, tuple(expected.shape))
    message = (
        f"{what}: element {position}{more}: expected {_fmt(want[index])}, got {_fmt(got[index])}"
    )
    reason = _explain(got, wrong, allowed, explanations or {}, before)
    raise AssertionError(message + (f" ({reason})" if reason else ""))


def check_unchanged(actual: torch.Tensor, original: torch.Tensor, what: str) -> None:
    """An argument that is not an output must come back exactly as it was given."""
    if not torch.equal(actual.detach().cpu(), original.detach().cpu()):
        index = int((actual.detach().cpu() != original.detach().cpu()).reshape(-1).nonzero()[0])
        where = _position(index, tuple(original.shape))
        raise AssertionError(
            f"{what} was modified, but it is an input: element {where} "
            f"was {_fmt(original.reshape(-1)[index])}, now {_fmt(actual.reshape(-1)[index])}"
        )


def _explain(
    got: torch.Tensor,
    wrong: torch.Tensor,
    allowed: torch.Tensor | float,
    explanations: dict[str, torch.Tensor],
    before: torch.Tensor | None,
) -> str:
    """The first explanation that accounts for every wrong element, or ''."""
    if before is not None and torch.equal(got, before.detach().cpu().reshape(-1).double()):
        return "the tensor was not written: results must be stored in place, in the given tensor"
    for reason, alternative in explanations.items():
        candidate = alternative.detach().cpu().reshape(-1).double()
        if candidate.numel() != got.numel():
            continue
        fits = (got - candidate).abs() <= 2 * allowed
        if bool(fits[wrong].all()):
            return reason
    return ""


def _position(index: int, shape: tuple[int, ...]) -> str:
    if len(shape) <= 1:
        return str(index)
    coordinates = []
    for size in reversed(shape):
        coordinates.append(index % size)
        index //= size
    return "[" + ", ".join(str(c) for c in reversed(coordinates)) + "]"


def _fmt(value: torch.Tensor) -> str:
    number = float(value)
    return str(int(number)) if number.is_integer() and abs(number) < 1e15 else f"{number:.6g}"
