"""What a wrong result looks like, tried on the trusted side's expected values.

:func:`explain` tries, in order, the patterns a usual mistake leaves, and says the first
that accounts for every wrong element, in the student's words, or nothing: never a guess
that the values do not support. The patterns:

- another rank's expected value (which one: the rank before or after, in a ring);
- the right values in another order (rows or positions permuted);
- a uniform factor (p, 1/p, 2, 1/2);
- a region: wrong only where it is (the padding), or exactly where it is (the query rows
  that merge several blocks), or NaN exactly there (rows left with nothing to attend to).

:class:`Expected` carries what the caller knows beyond the one expected tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class Region:
    """A set of elements (``mask``, broadcast to the result) that a mistake touches.

    ``exact``: the wrong elements lie in exactly these rows (along ``rows_dim``), not just
    within them; ``nan``: the elements that are NaN, not the wrong ones, are compared.
    """

    mask: Tensor
    words: str
    exact: bool = False
    nan: bool = False
    rows_dim: int = 0


@dataclass(frozen=True)
class Expected:
    """What the comparison knows besides the expected tensor: every rank's expected value
    (``peers``, this one ``rank``'s among them, with their rounding ``bounds``: see
    :func:`grader.testkit.compare.peer_bounds`) and the words for a neighbour's (offset +1
    or -1: "the ring turned the wrong way"), the world size for the factors, the dimension
    whose order is the rank's choice to get wrong, and the regions a mistake may touch."""

    rank: int | None = None
    peers: Sequence[Tensor] = ()
    bounds: Sequence[Tensor | float] = ()  # each peer's rounding bound, where known
    neighbours: dict[int, str] = field(default_factory=dict)
    p: int | None = None
    rows_dim: int | None = None
    regions: Sequence[Region] = ()


def explain(
    got: Tensor, want: Tensor, wrong: Tensor, allowed: Tensor | float, context: Expected
) -> tuple[str, bool]:
    """The first pattern that accounts for every wrong element ('' if none), and whether it
    accounts for their values too (a region says only where they are wrong).

    ``got``, ``want``: float64 tensors of the result's shape; ``wrong``: the elements beyond
    the tolerance ``allowed`` (of the same shape, or a number).
    """
    for attempt in (_another_rank, _reordered, _factor):
        reason = attempt(got, want, wrong, allowed, context)
        if reason:
            return reason, True
    return _region(got, want, wrong, allowed, context), False


def explain_within(got: Tensor, want: Tensor, allowed: float, context: Expected) -> str:
    """:func:`explain` for a check of its own tolerance: ``allowed``, one bound for all."""
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    wrong = ~((got - want).abs() <= allowed)  # NaN counts as wrong
    return explain(got, want, wrong, allowed, context)[0] if bool(wrong.any()) else ""


def _fits(got: Tensor, candidate: Tensor, wrong: Tensor, allowed: Tensor | float) -> bool:
    if candidate.shape != got.shape:
        return False
    return bool(((got - candidate).abs() <= 2 * allowed)[wrong].all())


def _another_rank(
    got: Tensor, want: Tensor, wrong: Tensor, allowed: Tensor | float, context: Expected
) -> str:
    if context.rank is None:
        return ""
    p = len(context.peers)
    for offset in sorted(range(1, p), key=lambda o: min(o, p - o)):
        other = (context.rank + offset) % p
        peer = context.peers[other].detach().cpu().double()
        # The rounding bound grows with the values: another rank's may be larger than ours.
        bound = context.bounds[other] if context.bounds else allowed
        if isinstance(bound, Tensor):
            bound = bound.reshape(got.shape)
        if torch.equal(peer, want) or not _fits(got, peer, wrong, bound):
            continue
        words = context.neighbours.get(offset) or context.neighbours.get(offset - p, "")
        return f"it is rank {other}'s expected value" + (f": {words}" if words else "")
    return ""


def _reordered(
    got: Tensor, want: Tensor, wrong: Tensor, allowed: Tensor | float, context: Expected
) -> str:
    """The right rows (slices along ``rows_dim``), each somewhere else."""
    dim = context.rows_dim
    if dim is None or got.dim() == 0 or got.size(dim) < 2:
        return ""
    rows_got, rows_want = got.movedim(dim, 0), want.movedim(dim, 0)
    size = rows_got.size(0)
    flat_got, flat_want = rows_got.reshape(size, -1), rows_want.reshape(size, -1)
    bound = allowed if isinstance(allowed, float) else allowed.movedim(dim, 0).reshape(size, -1)
    gap = (flat_got[:, None, :] - flat_want[None, :, :]).abs()
    matches = (gap <= 2 * (bound if isinstance(bound, float) else bound[None])).all(-1)
    moved = [i for i in range(size) if not bool(matches[i, i])]
    if not moved or not all(bool(matches[i].any()) for i in range(size)):
        return ""
    i = moved[0]
    j = int(matches[i].nonzero()[0])
    word = "position" if dim == got.dim() - 2 and got.dim() > 2 else "row"
    return (
        f"the right values in another order: its {word} {i} holds what belongs at {word} {j} "
        f"({len(moved)} of {size} {word}s moved)"
    )


FACTORS = ("p", "1/p", "2", "1/2")


def _factor(
    got: Tensor, want: Tensor, wrong: Tensor, allowed: Tensor | float, context: Expected
) -> str:
    values = {"2": 2.0, "1/2": 0.5}
    if context.p is not None and context.p > 2:
        values = {"p": float(context.p), "1/p": 1 / context.p, **values}
    for name, factor in values.items():
        if _fits(got, factor * want, wrong, factor * allowed):
            shown = name if name in ("2", "1/2") else f"{name} = {factor:g}"
            return f"it is {shown} times the expected value"
    return ""


def _region(
    got: Tensor, want: Tensor, wrong: Tensor, allowed: Tensor | float, context: Expected
) -> str:
    for region in context.regions:
        mask = region.mask.expand_as(got)
        if region.nan:  # the NaN rows are exactly the region's; other values may be wrong
            nan = got.isnan()
            if bool(nan.any()) and torch.equal(
                _rows(nan, region.rows_dim), _rows(mask, region.rows_dim)
            ):
                return region.words
        elif region.exact:  # wrong exactly in the region's rows, and nowhere else
            if torch.equal(_rows(wrong, region.rows_dim), _rows(mask, region.rows_dim)) and bool(
                mask[wrong].all()
            ):
                return region.words
        elif bool(mask[wrong].all()):  # wrong only inside the region
            return region.words
    return ""


def _rows(mask: Tensor, dim: int) -> Tensor:
    """Which rows along ``dim`` hold at least one element of ``mask``."""
    return mask.movedim(dim, 0).reshape(mask.size(dim), -1).any(1)
