"""Comparing a student's tensor with the expected one, and saying what went wrong.

A bare "tensors differ" teaches nothing. :func:`check_close` finds the first
wrong element and tries the usual mistakes on it: a rank's contribution
missing or counted twice, another rank's data in place of the right one, the
tensor coming back as it went in, a sum accumulated in too low a precision.
The graded tests pass the data-dependent explanations in, since only they know
what each rank contributed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from grader.broker.traffic import Event
from grader.testkit.patterns import Expected, explain
from grader.tolerances import ROUNDING_ULPS as FLOAT_TOLERANCE_ULPS

UNCHANGED = (
    "it came back unchanged: nothing was received into it, or the result was never copied "
    "back into it with copy_"
)
# The dtype one precision below each float dtype, as students reach for it: summing in
# float32 a float64 tensor, or in bfloat16 (autocast, a bf16 buffer) a float32 one.
LOWER_PRECISION = {torch.float64: torch.float32, torch.float32: torch.bfloat16}
# Below this relative error a wrong element is a rounding question, not a wrong value:
# the message then gives the error against the tolerance, not just two numbers.
PRECISION_RELATIVE_ERROR = 1e-2
_MAX_DIGITS = 17  # enough to tell any two distinct doubles apart


class WrongResult(AssertionError):
    """A result that is not the expected one (its values, shape or dtype): the summary takes
    every wrong result of a function as one cause, whatever its numbers. ``reason``: the
    usual mistake that accounts for its values, when one does (not figures, nor a region
    that says only where it is wrong)."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


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


def peer_bounds(
    dtype: torch.dtype, magnitudes: Sequence[torch.Tensor], terms: int
) -> list[torch.Tensor | float]:
    """Each rank's rounding bound (:func:`tolerance`), from the magnitudes behind its expected
    values: what another rank's value may be off by when a rank returns it."""
    return [tolerance(dtype, m.detach().cpu().double(), terms) for m in magnitudes]


def sums_in_float64(terms: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of ``terms`` in float64, and the sum of their absolute values (the
    ``magnitude`` that :func:`check_close` bounds a sum's rounding by), added one term at a
    time into one float64 accumulator each, not stacked first: for the 4 MB inputs of a
    performance test that is 6 ms instead of 35."""
    total = terms[0].to(torch.float64, copy=True)  # a copy: the terms are added into it in place
    magnitude = terms[0].abs().to(torch.float64)
    for term in terms[1:]:
        total.add_(term)
        magnitude.add_(term.abs())
    return total, magnitude


def check_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    what: str,
    *,
    magnitude: torch.Tensor | None = None,
    terms: int = 1,
    explanations: dict[str, torch.Tensor] | Callable[[], dict[str, torch.Tensor]] | None = None,
    before: torch.Tensor | None = None,
    context: Expected | None = None,
) -> None:
    """Raise :class:`WrongResult` naming the first wrong element of ``actual``, and why.

    ``magnitude``: the sum of the absolute values of the terms behind each
    expected element (for the float tolerance); ``explanations``: what the
    tensor would hold after each usual mistake, by a phrase describing it;
    ``before``: the tensor's contents before the call, i.e. the rank's own input
    (to recognise a tensor that came back unchanged); ``context``: what else the
    trusted side expects, for the patterns of :mod:`grader.testkit.patterns`.
    """
    if actual.shape != expected.shape:
        raise WrongResult(
            f"{what}: expected shape {tuple(expected.shape)}, got {tuple(actual.shape)}"
        )
    if actual.dtype != expected.dtype:
        raise WrongResult(f"{what}: expected dtype {expected.dtype}, got {actual.dtype}")
    if torch.equal(actual.detach().cpu(), expected.detach().cpu()):
        return  # the common case, and cheap: no NaN is equal to anything, so none passes here
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
    shown_want, shown_got = format_pair(float(want[index]), float(got[index]))
    message = f"{what}: element {position}{more}: expected {shown_want}, got {shown_got}"
    if callable(explanations):  # made only when needed: they cost as much as the check
        explanations = explanations()
    reason = _explain(got, wrong, allowed, explanations or {}, before)
    accounted = bool(reason) and reason != UNCHANGED
    if not reason:
        shaped = [t.reshape(expected.shape) for t in (got, want, wrong)]
        bound = allowed.reshape(expected.shape) if isinstance(allowed, torch.Tensor) else allowed
        reason, accounted = explain(*shaped, bound, context or Expected())
    if not reason and expected.dtype.is_floating_point:
        reason = _precision(got, want, wrong, index, allowed, scale, terms, expected.dtype)
    raise WrongResult(message + (f" ({reason})" if reason else ""), reason if accounted else "")


def check_unchanged(actual: torch.Tensor, original: torch.Tensor, what: str) -> None:
    """An argument that is not an output must come back exactly as it was given."""
    if not torch.equal(actual.detach().cpu(), original.detach().cpu()):
        index = int((actual.detach().cpu() != original.detach().cpu()).reshape(-1).nonzero()[0])
        where = _position(index, tuple(original.shape))
        was, now = format_pair(float(original.reshape(-1)[index]), float(actual.reshape(-1)[index]))
        raise AssertionError(
            f"{what} was modified, but it is an input: element {where} was {was}, now {now}"
        )


def format_pair(expected: float, actual: float) -> tuple[str, str]:
    """Both numbers, with as many significant digits as it takes for two different values
    to print differently: "expected -1.50163, got -1.50163" would contradict the verdict."""
    for digits in range(6, _MAX_DIGITS + 1):
        shown = _fmt(expected, digits), _fmt(actual, digits)
        if shown[0] != shown[1] or expected == actual:
            return shown
    return shown


def _explain(
    got: torch.Tensor,
    wrong: torch.Tensor,
    allowed: torch.Tensor | float,
    explanations: dict[str, torch.Tensor],
    before: torch.Tensor | None,
) -> str:
    """The first explanation that accounts for every wrong element, or ''."""
    if before is not None and torch.equal(got, before.detach().cpu().reshape(-1).double()):
        return UNCHANGED
    for reason, alternative in explanations.items():
        candidate = alternative.detach().cpu().reshape(-1).double()
        if candidate.numel() != got.numel():
            continue
        fits = (got - candidate).abs() <= 2 * allowed
        if bool(fits[wrong].all()):
            return reason
    return ""


def _precision(
    got: torch.Tensor,
    want: torch.Tensor,
    wrong: torch.Tensor,
    index: int,
    allowed: torch.Tensor | float,
    scale: torch.Tensor,
    terms: int,
    dtype: torch.dtype,
) -> str:
    """The error against the tolerance when the value is nearly right, and the likely cause
    when a lower precision's rounding accounts for every wrong element."""
    error = abs(float(got[index]) - float(want[index]))
    size = abs(float(want[index]))
    if not error <= PRECISION_RELATIVE_ERROR * max(size, float(scale[index])):
        return ""  # NaN, or a wrong value: the numbers themselves tell
    limit = float(allowed[index]) if isinstance(allowed, torch.Tensor) else float(allowed)
    relative = f", relative {error / size:.2g}" if size > 0 else ""
    figures = f"off by {error:.2g}{relative}, tolerance {limit:.2g}"
    lower = LOWER_PRECISION.get(dtype)
    if lower is None:
        return figures
    # Said only where the values support it: every wrong one is a value of the lower dtype
    # (what a sum kept in it returns), within that dtype's rounding of the expected.
    lower_allowed = tolerance(lower, scale, terms)
    representable = got[wrong] == got[wrong].to(lower).double()
    if bool(representable.all()) and bool(((got - want).abs() <= lower_allowed)[wrong].all()):
        low, high = str(lower).removeprefix("torch."), str(dtype).removeprefix("torch.")
        return (
            f"{figures}: an error the size of {low}'s rounding, so likely accumulated in a "
            f"lower precision ({low}) than the {high} input: add in {high}"
        )
    return figures


def _position(index: int, shape: tuple[int, ...]) -> str:
    if len(shape) <= 1:
        return str(index)
    coordinates = []
    for size in reversed(shape):
        coordinates.append(index % size)
        index //= size
    return "[" + ", ".join(str(c) for c in reversed(coordinates)) + "]"


def _fmt(number: float, digits: int = 6) -> str:
    if number.is_integer() and abs(number) < 1e15:
        return str(int(number))
    return f"{number:.{digits}g}"


def require(condition: object, message: str) -> None:
    """Fail with ``message`` alone: what the student reads, without pytest's own rendering."""
    if not condition:
        raise AssertionError(message)


def on_every_rank(p: int, check: Callable[[int], None]) -> None:
    """Run ``check(r)`` for every rank; fail with the lowest rank's first problem.

    The ranks that failed with the very same message are named after it, so a student
    sees at once whether a mistake is on one rank or everywhere.
    """
    problems: dict[int, AssertionError] = {}
    for r in range(p):
        try:
            check(r)
        except AssertionError as err:
            problems[r] = err
    if problems:
        error = problems[min(problems)]
        message = rank_blame({r: str(e) for r, e in problems.items()})
        if isinstance(error, WrongResult):  # a wrong result stays one, with the cause
            # that accounts for every rank's, if one does
            causes = {getattr(e, "reason", "") for e in problems.values()}
            raise WrongResult(message, error.reason if "" not in causes else "")
        raise type(error)(message)


def rank_blame(problems: dict[int, str], prefix: str = "", others: bool = False) -> str:
    """The lowest rank's problem, and the ranks with the very same one (so that a student
    sees at once whether a mistake is on one rank or everywhere); ``others``: the next
    rank with another problem too."""
    first = min(problems)
    text = problems[first]
    same = [r for r in sorted(problems) if r != first and problems[r] == text]
    rest = [r for r in sorted(problems) if r != first and r not in same]
    message = f"rank {first}: {prefix}{text}"
    if same:
        message += f" (the same on rank{'s' * (len(same) > 1)} {', '.join(map(str, same))})"
    if others and rest:
        message += f"; rank {rest[0]} is wrong too: {problems[rest[0]]}"
    return message


def named_cause(check: Callable[[], None]) -> str | None:
    """Run the correctness ``check`` of a test that judges messages: a wrong result that a
    usual mistake accounts for is the correctness tests' to deduct, and comes back as their
    message (None: right); any other failure fails this test too."""
    try:
        check()
    except WrongResult as err:
        if not err.reason:
            raise
        return str(err)
    return None


def carried(event: Event) -> torch.Tensor:
    """The tensor a collective's input carried, as the broker received it, in float64."""
    dtype = getattr(torch, event.dtype or "float32")
    if not event.payload:  # frombuffer refuses an empty buffer
        return torch.zeros(0, dtype=torch.float64)
    return torch.frombuffer(bytearray(event.payload), dtype=dtype).double()


def nearest(values: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """For each of ``values``, the index of the value nearest it in ``pool`` (sorted, not
    empty): one of the two around where it would be inserted."""
    above = torch.searchsorted(pool, values).clamp(max=len(pool) - 1)
    below = (above - 1).clamp(min=0)
    return torch.where((pool[below] - values).abs() < (pool[above] - values).abs(), below, above)
