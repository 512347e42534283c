"""Graded tests of ``assignments/collectives.py``: each collective, at every world size.

Each test runs one collective over many cases: four dtypes; one element (fewer
than the ranks), a size the world size does not divide, a non-contiguous 2-D
view, and one large tensor of at least 1M elements; every root for the rooted
operations. The inputs are made here, in the grader's process, from a secret
seed; each rank gets its own and sends back the caller's tensors after the
call, which are compared here. Built-in collectives are refused by the broker
while these tests run (``forbid_collectives`` in grading.yaml).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import pytest
import torch

from grader.testkit import (
    CallResult,
    World,
    check_close,
    check_informed,
    check_unchanged,
    rank_tensor,
    sums_in_float64,
)

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64)
LARGE = 1_000_003  # elements in all, across the ranks' pieces for the list-based operations


@dataclass(frozen=True)
class Case:
    """One input layout: every rank's tensor (or list item) has ``shape`` and ``dtype``."""

    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    contiguous: bool = True

    def tensor(self, rank: int, item: int = 0, root: int = 0) -> torch.Tensor:
        key = f"{self.op}/{self.shape}/{self.dtype}/{self.contiguous}/root{root}/item{item}"
        return rank_tensor(key, rank, self.shape, self.dtype, contiguous=self.contiguous)

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype)

    def __str__(self) -> str:
        layout = "" if self.contiguous else "non-contiguous "
        dims = "x".join(map(str, self.shape))
        return f"{layout}{str(self.dtype).removeprefix('torch.')}[{dims}]"


def cases(op: str, world_size: int, per_item: bool = False) -> Iterator[Case]:
    for dtype in DTYPES:
        yield Case(op, (1,), dtype)
        yield Case(op, (2 * world_size + 1,), dtype)
        yield Case(op, (3, 5), dtype, contiguous=False)
    large = -(-LARGE // world_size) if per_item else LARGE
    yield Case(op, (large,), torch.float32)


def roots(world_size: int, case: Case) -> range:
    """Every root for the small cases; the last rank alone for the large one."""
    return range(world_size) if case.shape[0] < LARGE // 8 else range(world_size - 1, world_size)


def nbytes(*tensors: torch.Tensor) -> int:
    """The bytes of data these tensors hold: what a rank must receive to know them."""
    return sum(t.numel() * t.element_size() for t in tensors)


def total(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return summed(tensors, dtype)[0]


def summed(tensors: list[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum in ``dtype``, and its magnitude (the sum of the absolute values, in float64)."""
    exact, magnitude = sums_in_float64(tensors)
    return exact.to(dtype), magnitude


def sum_mistakes(parts: list[torch.Tensor], expected: torch.Tensor, who: str = "rank") -> dict:
    """What a wrong sum would hold: each contribution missing, doubled, or alone."""
    explanations = {}
    for r, part in enumerate(parts):
        explanations[f"{who} {r}'s contribution is missing"] = expected.double() - part.double()
        explanations[f"{who} {r}'s contribution is counted twice"] = (
            expected.double() + part.double()
        )
    for r, part in enumerate(parts):
        explanations[f"it holds {who} {r}'s input alone"] = part
    return explanations


def scatter_mistakes(lists: list[list[torch.Tensor]], rank: int, expected: torch.Tensor) -> dict:
    """A reduce-scatter's usual mistakes: a sum gone wrong, or another rank's piece summed."""
    p = len(lists)
    explanations = sum_mistakes([lists[s][rank] for s in range(p)], expected)
    for j in range(p):
        if j != rank:
            explanations[f"it holds the sum of piece {j}, which belongs to rank {j}"] = total(
                [lists[s][j] for s in range(p)], expected.dtype
            )
    return explanations


def data_mistakes(candidates: dict[str, torch.Tensor], right: str) -> dict:
    return {
        f"it holds {label}, not {right}": t for label, t in candidates.items() if label != right
    }


def check_item(
    out: CallResult,
    rank: int,
    argument: int,
    item: int,
    expected: torch.Tensor,
    what: str,
    **explain: object,
) -> None:
    """Check item ``item`` of a list argument; name a rebound list entry as the cause."""
    rebound = f"args[{argument}][{item}]" in out.rebound[rank]
    try:
        check_close(out.args[rank][argument][item], expected, what, **explain)  # type: ignore[arg-type]
    except AssertionError as err:
        if not rebound:
            raise
        raise type(err)(
            f"{err} (the list item was replaced, not filled in: the caller's tensors must "
            "hold the result, so copy into them, e.g. tensor_list[i].copy_(...))"
        ) from None


@pytest.mark.graded(target="collectives.broadcast", kind="correctness")
def test_broadcast(world: World) -> None:
    p = world.size
    for case in cases("broadcast", p):
        for src in roots(p, case):
            inputs = [case.tensor(r, root=src) for r in range(p)]
            what = f"broadcast of {case} from rank {src}"
            args = [(inputs[r], src) for r in range(p)]  # sent as bytes: ours stay as they are
            out = world.call("collectives.broadcast", args, case=what)
            candidates = {f"rank {r}'s data": inputs[r] for r in range(p)}
            for r in range(p):
                if r == src:
                    check_unchanged(out.args[r][0], inputs[src], f"{what}: the source's tensor")
                    continue
                check_close(
                    out.args[r][0],
                    inputs[src],
                    f"rank {r}: {what}",
                    before=inputs[r],
                    explanations=data_mistakes(candidates, f"rank {src}'s data"),
                )
                check_informed(out, r, nbytes(inputs[src]), what)


@pytest.mark.graded(target="collectives.reduce", kind="correctness")
def test_reduce(world: World) -> None:
    p = world.size
    for case in cases("reduce", p):
        for dst in roots(p, case):
            inputs = [case.tensor(r, root=dst) for r in range(p)]
            what = f"reduce of {case} to rank {dst}"
            out = world.call("collectives.reduce", [(inputs[r], dst) for r in range(p)], case=what)
            for r in range(p):
                if r != dst:
                    check_unchanged(
                        out.args[r][0],
                        inputs[r],
                        f"{what}: rank {r}'s tensor (not the destination)",
                    )
            expected, size = summed(inputs, case.dtype)
            check_close(
                out.args[dst][0],
                expected,
                f"rank {dst}: {what}",
                magnitude=size,
                terms=p,
                explanations=partial(sum_mistakes, inputs, expected),
                before=inputs[dst],
            )
            if p > 1:  # the sum of the others' tensors: as many bytes as one
                check_informed(out, dst, nbytes(inputs[dst]), what)


@pytest.mark.graded(target="collectives.all_reduce", kind="correctness")
def test_all_reduce(world: World) -> None:
    p = world.size
    for case in cases("all_reduce", p):
        inputs = [case.tensor(r) for r in range(p)]
        what = f"all_reduce of {case}"
        out = world.call("collectives.all_reduce", [(inputs[r],) for r in range(p)], case=what)
        expected, size = summed(inputs, case.dtype)
        for r in range(p):
            check_close(
                out.args[r][0],
                expected,
                f"rank {r}: {what}",
                magnitude=size,
                terms=p,
                explanations=partial(sum_mistakes, inputs, expected),
                before=inputs[r],
            )
            if p > 1:
                check_informed(out, r, nbytes(inputs[r]), what)


@pytest.mark.graded(target="collectives.scatter", kind="correctness")
def test_scatter(world: World) -> None:
    p = world.size
    for case in cases("scatter", p, per_item=True):
        for src in roots(p, case):
            pieces = [case.tensor(src, item=r, root=src) for r in range(p)]
            what = f"scatter of {case} pieces from rank {src}"
            args = [
                (case.zeros(), pieces, src) if r == src else (case.zeros(), None, src)
                for r in range(p)
            ]
            out = world.call("collectives.scatter", args, case=what)
            candidates = {f"piece {r} of the scatter_list": pieces[r] for r in range(p)}
            for r in range(p):
                check_close(
                    out.args[r][0],
                    pieces[r],
                    f"rank {r}: {what}",
                    before=case.zeros(),
                    explanations=data_mistakes(candidates, f"piece {r} of the scatter_list"),
                )
                if r != src:
                    check_informed(out, r, nbytes(pieces[r]), what)
            for i, item in enumerate(out.args[src][1]):
                check_unchanged(item, pieces[i], f"{what}: scatter_list[{i}] on the source")


@pytest.mark.graded(target="collectives.gather", kind="correctness")
def test_gather(world: World) -> None:
    p = world.size
    for case in cases("gather", p, per_item=True):
        for dst in roots(p, case):
            inputs = [case.tensor(r, root=dst) for r in range(p)]
            what = f"gather of {case} to rank {dst}"
            args = [
                (
                    inputs[r],
                    [case.zeros() for _ in range(p)] if r == dst else None,
                    dst,
                )
                for r in range(p)
            ]
            out = world.call("collectives.gather", args, case=what)
            for r in range(p):
                check_unchanged(out.args[r][0], inputs[r], f"{what}: rank {r}'s input tensor")
            candidates = {f"rank {r}'s tensor": inputs[r] for r in range(p)}
            for r in range(p):
                check_item(
                    out,
                    dst,
                    1,
                    r,
                    inputs[r],
                    f"rank {dst}: {what}: gather_list[{r}]",
                    before=case.zeros(),
                    explanations=data_mistakes(candidates, f"rank {r}'s tensor"),
                )
            others = [inputs[r] for r in range(p) if r != dst]
            check_informed(out, dst, nbytes(*others), what)


@pytest.mark.graded(target="collectives.all_gather", kind="correctness")
def test_all_gather(world: World) -> None:
    p = world.size
    for case in cases("all_gather", p, per_item=True):
        inputs = [case.tensor(r) for r in range(p)]
        what = f"all_gather of {case}"
        args = [([case.zeros() for _ in range(p)], inputs[r]) for r in range(p)]
        out = world.call("collectives.all_gather", args, case=what)
        candidates = {f"rank {r}'s tensor": inputs[r] for r in range(p)}
        for rank in range(p):
            check_unchanged(out.args[rank][1], inputs[rank], f"{what}: rank {rank}'s input tensor")
            for r in range(p):
                check_item(
                    out,
                    rank,
                    0,
                    r,
                    inputs[r],
                    f"rank {rank}: {what}: tensor_list[{r}]",
                    before=case.zeros(),
                    explanations=data_mistakes(candidates, f"rank {r}'s tensor"),
                )
            check_informed(out, rank, nbytes(*(inputs[r] for r in range(p) if r != rank)), what)


@pytest.mark.graded(target="collectives.reduce_scatter", kind="correctness")
def test_reduce_scatter(world: World) -> None:
    p = world.size
    for case in cases("reduce_scatter", p, per_item=True):
        lists = [[case.tensor(s, item=r) for r in range(p)] for s in range(p)]
        what = f"reduce_scatter of {case} pieces"
        args = [(case.zeros(), lists[s]) for s in range(p)]
        out = world.call("collectives.reduce_scatter", args, case=what)
        for rank in range(p):
            for r, item in enumerate(out.args[rank][1]):
                check_unchanged(item, lists[rank][r], f"{what}: rank {rank}'s input_list[{r}]")
            mine = [lists[s][rank] for s in range(p)]
            expected, size = summed(mine, case.dtype)
            check_close(
                out.args[rank][0],
                expected,
                f"rank {rank}: {what}: its output",
                magnitude=size,
                terms=p,
                explanations=partial(scatter_mistakes, lists, rank, expected),
                before=case.zeros(),
            )
            if p > 1:
                check_informed(out, rank, nbytes(expected), what)


@pytest.mark.graded(target="collectives.all_to_all", kind="correctness")
def test_all_to_all(world: World) -> None:
    p = world.size
    for case in cases("all_to_all", p, per_item=True):
        lists = [[case.tensor(s, item=r) for r in range(p)] for s in range(p)]
        what = f"all_to_all of {case} pieces"
        args = [([case.zeros() for _ in range(p)], lists[s]) for s in range(p)]
        out = world.call("collectives.all_to_all", args, case=what)
        candidates = {
            f"rank {t}'s input_list[{j}]": lists[t][j] for t in range(p) for j in range(p)
        }
        for rank in range(p):
            for r, item in enumerate(out.args[rank][1]):
                check_unchanged(item, lists[rank][r], f"{what}: rank {rank}'s input_list[{r}]")
            for s in range(p):
                check_item(
                    out,
                    rank,
                    0,
                    s,
                    lists[s][rank],
                    f"rank {rank}: {what}: output_list[{s}]",
                    before=case.zeros(),
                    explanations=data_mistakes(candidates, f"rank {s}'s input_list[{rank}]"),
                )
            theirs = [lists[s][rank] for s in range(p) if s != rank]
            check_informed(out, rank, nbytes(*theirs), what)
