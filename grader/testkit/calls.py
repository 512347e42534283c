"""One call of a collective on n float32 elements in all, made the same way for every caller.

Shared by the cost tests and by the reference traces they compare with, so
that the student's and the reference's messages are counted on identical
work. n is the whole array (nccl-tests' convention): the tensor of a
broadcast, reduce or all-reduce; the concatenation of the pieces of the
list-based ones. Each output comes with its expected value, so that a cost
test checks the result like any other test: a fast wrong answer earns nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from grader.protocol import OpName
from grader.testkit.compare import sums_in_float64
from grader.testkit.data import rank_tensor

COLLECTIVES = (
    OpName.BROADCAST,
    OpName.REDUCE,
    OpName.ALL_REDUCE,
    OpName.SCATTER,
    OpName.GATHER,
    OpName.ALL_GATHER,
    OpName.REDUCE_SCATTER,
    OpName.ALL_TO_ALL,
)
ROOT = 0


@dataclass(frozen=True)
class Expected:
    """Rank ``rank``'s argument ``argument`` (item ``item`` of a list) must equal ``value``."""

    rank: int
    argument: int
    item: int | None
    value: torch.Tensor
    magnitude: torch.Tensor | None = None  # of a sum: the sum of its terms' absolute values


def collective_call(
    function: str, p: int, n: int, key: str = "costs"
) -> tuple[list[tuple[Any, ...]], list[Expected]]:
    """Every rank's arguments for one call of ``function``, and the outputs it must produce."""
    piece = n // p

    def data(rank: int, item: int = -1) -> torch.Tensor:
        size = n if item < 0 else piece
        return rank_tensor(f"{key}/{function}/{n}/{item}", rank, (size,), torch.float32)

    def zeros() -> torch.Tensor:
        return torch.zeros(piece)

    # The arguments go to the ranks as bytes (:mod:`grader.wire`): the tensors here stay as
    # they are, and serve as the expected values too.
    ranks = range(p)
    if function in (OpName.BROADCAST, OpName.REDUCE, OpName.ALL_REDUCE):
        inputs = [data(r) for r in ranks]
        if function == OpName.BROADCAST:
            args = [(inputs[r], ROOT) for r in ranks]
            return args, [Expected(r, 0, None, inputs[ROOT]) for r in ranks]
        total, size = sums_in_float64(inputs)
        args = [(inputs[r],) if function == OpName.ALL_REDUCE else (inputs[r], ROOT) for r in ranks]
        targets = [ROOT] if function == OpName.REDUCE else list(ranks)
        return args, [Expected(r, 0, None, total.float(), size) for r in targets]
    pieces = [[data(r, i) for i in ranks] for r in ranks]
    if function == OpName.SCATTER:
        args = [(zeros(), pieces[r] if r == ROOT else None, ROOT) for r in ranks]
        return args, [Expected(r, 0, None, pieces[ROOT][r]) for r in ranks]
    if function == OpName.GATHER:
        args = [
            (pieces[r][0], [zeros() for _ in ranks] if r == ROOT else None, ROOT) for r in ranks
        ]
        return args, [Expected(ROOT, 1, i, pieces[i][0]) for i in ranks]
    if function == OpName.ALL_GATHER:
        args = [([zeros() for _ in ranks], pieces[r][0]) for r in ranks]
        return args, [Expected(r, 0, i, pieces[i][0]) for r in ranks for i in ranks]
    if function == OpName.REDUCE_SCATTER:
        args = [(zeros(), pieces[r]) for r in ranks]
        sums = [sums_in_float64([pieces[s][r] for s in ranks]) for r in ranks]
        return args, [
            Expected(r, 0, None, total.float(), size) for r, (total, size) in enumerate(sums)
        ]
    if function == OpName.ALL_TO_ALL:
        args = [([zeros() for _ in ranks], pieces[r]) for r in ranks]
        return args, [Expected(r, 0, s, pieces[s][r]) for r in ranks for s in ranks]
    raise ValueError(f"unknown collective {function}")


def output(out_args: list[tuple[Any, ...]], expected: Expected) -> torch.Tensor:
    value = out_args[expected.rank][expected.argument]
    return value if expected.item is None else value[expected.item]
