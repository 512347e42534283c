"""Graded tests of ``assignments/collectives.py``: each collective, at every world size.

Each test runs one collective over many cases: four dtypes; one element (fewer
than the ranks), a size the world size does not divide, a non-contiguous 2-D
view, and one large tensor of at least 1M elements; every root for the rooted
operations. Every rank recomputes every other rank's seeded input, so the
expected result is computed locally. Built-in collectives are blocked while
these tests run (``forbid_collectives`` in grading.yaml).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch

from grader.testkit import check_close, check_unchanged, rank_tensor

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


def total(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.stack([t.double() for t in tensors]).sum(0).to(dtype)


def magnitude(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.double().abs() for t in tensors]).sum(0)


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


def data_mistakes(candidates: dict[str, torch.Tensor], right: str) -> dict:
    return {
        f"it holds {label}, not {right}": t for label, t in candidates.items() if label != right
    }


@pytest.mark.graded(target="collectives.broadcast", kind="correctness")
def test_broadcast(student: ModuleType, rank: int, world_size: int) -> None:
    for case in cases("broadcast", world_size):
        for src in roots(world_size, case):
            inputs = [case.tensor(r, root=src) for r in range(world_size)]
            mine = case.tensor(rank, root=src)
            student.broadcast(mine, src)
            what = f"broadcast of {case} from rank {src}"
            if rank == src:
                check_unchanged(mine, inputs[src], f"{what}: the source's tensor")
                continue
            candidates = {f"rank {r}'s data": inputs[r] for r in range(world_size)}
            check_close(
                mine,
                inputs[src],
                what,
                before=inputs[rank],
                explanations=data_mistakes(candidates, f"rank {src}'s data"),
            )


@pytest.mark.graded(target="collectives.reduce", kind="correctness")
def test_reduce(student: ModuleType, rank: int, world_size: int) -> None:
    for case in cases("reduce", world_size):
        for dst in roots(world_size, case):
            inputs = [case.tensor(r, root=dst) for r in range(world_size)]
            mine = case.tensor(rank, root=dst)
            student.reduce(mine, dst)
            what = f"reduce of {case} to rank {dst}"
            if rank != dst:
                check_unchanged(
                    mine, inputs[rank], f"{what}: rank {rank}'s tensor (not the destination)"
                )
                continue
            expected = total(inputs, case.dtype)
            check_close(
                mine,
                expected,
                what,
                magnitude=magnitude(inputs),
                terms=world_size,
                explanations=sum_mistakes(inputs, expected),
                before=inputs[rank],
            )


@pytest.mark.graded(target="collectives.all_reduce", kind="correctness")
def test_all_reduce(student: ModuleType, rank: int, world_size: int) -> None:
    for case in cases("all_reduce", world_size):
        inputs = [case.tensor(r) for r in range(world_size)]
        mine = case.tensor(rank)
        student.all_reduce(mine)
        expected = total(inputs, case.dtype)
        check_close(
            mine,
            expected,
            f"all_reduce of {case}",
            magnitude=magnitude(inputs),
            terms=world_size,
            explanations=sum_mistakes(inputs, expected),
            before=inputs[rank],
        )


@pytest.mark.graded(target="collectives.scatter", kind="correctness")
def test_scatter(student: ModuleType, rank: int, world_size: int) -> None:
    for case in cases("scatter", world_size, per_item=True):
        for src in roots(world_size, case):
            pieces = [case.tensor(src, item=r, root=src) for r in range(world_size)]
            scatter_list = (
                [case.tensor(src, item=r, root=src) for r in range(world_size)]
                if rank == src
                else None
            )
            mine = torch.zeros(case.shape, dtype=case.dtype)
            student.scatter(mine, scatter_list, src)
            what = f"scatter of {case} pieces from rank {src}"
            candidates = {f"piece {r} of the scatter_list": pieces[r] for r in range(world_size)}
            check_close(
                mine,
                pieces[rank],
                f"{what}, rank {rank}'s piece",
                before=torch.zeros(case.shape),
                explanations=data_mistakes(candidates, f"piece {rank} of the scatter_list"),
            )
            if scatter_list is not None:
                for r, item in enumerate(scatter_list):
                    check_unchanged(item, pieces[r], f"{what}: scatter_list[{r}] on the source")


@pytest.mark.graded(target="collectives.gather", kind="correctness")
def test_gather(student: ModuleType, rank: int, world_size: int) -> None:
    for case in cases("gather", world_size, per_item=True):
        for dst in roots(world_size, case):
            inputs = [case.tensor(r, root=dst) for r in range(world_size)]
            mine = case.tensor(rank, root=dst)
            gather_list = (
                [torch.zeros(case.shape, dtype=case.dtype) for _ in range(world_size)]
                if rank == dst
                else None
            )
            student.gather(mine, gather_list, dst)
            what = f"gather of {case} to rank {dst}"
            check_unchanged(mine, inputs[rank], f"{what}: rank {rank}'s input tensor")
            if gather_list is None:
                continue
            candidates = {f"rank {r}'s tensor": inputs[r] for r in range(world_size)}
            for r in range(world_size):
                check_close(
                    gather_list[r],
                    inputs[r],
                    f"{what}: gather_list[{r}]",
                    before=torch.zeros(case.shape),
                    explanations=data_mistakes(candidates, f"rank {r}'s tensor"),
                )


@pytest.mark.graded(target="collectives.all_gather", kind="correctness")
def test_all_gather(student: ModuleType, rank: int, world_size: int) -> None:
    for case in cases("all_gather", world_size, per_item=True):
        inputs = [case.tensor(r) for r in range(world_size)]
        mine = case.tensor(rank)
        tensor_list = [torch.zeros(case.shape, dtype=case.dtype) for _ in range(world_size)]
        student.all_gather(tensor_list, mine)
        what = f"all_gather of {case}"
        check_unchanged(mine, inputs[rank], f"{what}: rank {rank}'s input tensor")
        candidates = {f"rank {r}'s tensor": inputs[r] for r in range(world_size)}
        for r in range(world_size):
            check_close(
                tensor_list[r],
                inputs[r],
                f"{what}: tensor_list[{r}]",
                before=torch.zeros(case.shape),
                explanations=data_mistakes(candidates, f"rank {r}'s tensor"),
            )


@pytest.mark.graded(target="collectives.reduce_scatter", kind="correctness")
def test_reduce_scatter(student: ModuleType, rank: int, world_size: int) -> None:
    for case in cases("reduce_scatter", world_size, per_item=True):
        lists = [[case.tensor(s, item=r) for r in range(world_size)] for s in range(world_size)]
        input_list = [case.tensor(rank, item=r) for r in range(world_size)]
        output = torch.zeros(case.shape, dtype=case.dtype)
        student.reduce_scatter(output, input_list)
        what = f"reduce_scatter of {case} pieces"
        for r, item in enumerate(input_list):
            check_unchanged(item, lists[rank][r], f"{what}: input_list[{r}]")
        mine = [lists[s][rank] for s in range(world_size)]
        expected = total(mine, case.dtype)
        explanations = sum_mistakes(mine, expected)
        for j in range(world_size):
            if j != rank:
                explanations[f"it holds the sum of piece {j}, which belongs to rank {j}"] = total(
                    [lists[s][j] for s in range(world_size)], case.dtype
                )
        check_close(
            output,
            expected,
            f"{what}: rank {rank}'s output",
            magnitude=magnitude(mine),
            terms=world_size,
            explanations=explanations,
            before=torch.zeros(case.shape),
        )


@pytest.mark.graded(target="collectives.all_to_all", kind="correctness")
def test_all_to_all(student: ModuleType, rank: int, world_size: int) -> None:
    for case in cases("all_to_all", world_size, per_item=True):
        lists = [[case.tensor(s, item=r) for r in range(world_size)] for s in range(world_size)]
        input_list = [case.tensor(rank, item=r) for r in range(world_size)]
        output_list = [torch.zeros(case.shape, dtype=case.dtype) for _ in range(world_size)]
        student.all_to_all(output_list, input_list)
        what = f"all_to_all of {case} pieces"
        for r, item in enumerate(input_list):
            check_unchanged(item, lists[rank][r], f"{what}: input_list[{r}]")
        for s in range(world_size):
            candidates = {
                f"rank {t}'s input_list[{j}]": lists[t][j]
                for t in range(world_size)
                for j in range(world_size)
            }
            check_close(
                output_list[s],
                lists[s][rank],
                f"{what}: output_list[{s}]",
                before=torch.zeros(case.shape),
                explanations=data_mistakes(candidates, f"rank {s}'s input_list[{rank}]"),
            )
