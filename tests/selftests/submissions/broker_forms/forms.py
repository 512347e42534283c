"""Every form of the collectives a strategy part may call, run once each: the broker's results
must be gloo's (tests/selftests/test_broker_forms.py runs this on both and compares).

Inputs are small integers in float32, so that any summation order gives the same sum.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

ReduceOp = dist.ReduceOp


def _data(rank: int, *shape: int) -> Tensor:
    n = 1
    for size in shape:
        n *= size
    return (torch.arange(n, dtype=torch.float32) + 100 * rank).reshape(shape)


def _splits(p: int, rank: int) -> list[int]:
    """Rows this rank sends to each rank: uneven, and zero to the rank after it."""
    return [0 if j == (rank + 1) % p and p > 1 else (rank + j) % 3 + 1 for j in range(p)]


def _all_gather_list(p: int, r: int, async_op: bool) -> list[Tensor]:
    out = [torch.empty(2, 3) for _ in range(p)]
    _finish(dist.all_gather(out, _data(r, 2, 3), async_op=async_op))
    return out


def _gather_into(fn: Callable, p: int, r: int, async_op: bool) -> list[Tensor]:
    out = torch.empty(p * 2, 3)
    _finish(fn(out, _data(r, 2, 3), async_op=async_op))
    return [out]


def _reduce_scatter_list(p: int, r: int, async_op: bool, op: ReduceOp) -> list[Tensor]:
    out = torch.empty(4)
    _finish(dist.reduce_scatter(out, list(_data(r, p, 4)), op=op, async_op=async_op))
    return [out]


def _scatter_into(fn: Callable, p: int, r: int, async_op: bool, op: ReduceOp) -> list[Tensor]:
    out = torch.empty(2, 2)
    _finish(fn(out, _data(r, p * 2, 2), op=op, async_op=async_op))
    return [out]


def _all_to_all_list(p: int, r: int, async_op: bool) -> list[Tensor]:
    """Equal pieces: gloo refuses uneven ones in the list form (NCCL takes them)."""
    out = [torch.empty(2, 2) for _ in range(p)]
    _finish(dist.all_to_all(out, [_data(r * 10 + j, 2, 2) for j in range(p)], async_op=async_op))
    return out


def _all_to_all_even(p: int, r: int, async_op: bool) -> list[Tensor]:
    out = torch.empty(p * 2, 3)
    _finish(dist.all_to_all_single(out, _data(r, p * 2, 3), async_op=async_op))
    return [out]


def _all_to_all_uneven(p: int, r: int, async_op: bool) -> list[Tensor]:
    send = _splits(p, r)
    recv = [_splits(p, j)[r] for j in range(p)]
    out = torch.empty(sum(recv), 2)
    work = dist.all_to_all_single(
        out, _data(r, sum(send), 2), output_split_sizes=recv, input_split_sizes=send,
        async_op=async_op,
    )  # fmt: skip
    _finish(work)
    return [out]


def _all_reduce(p: int, r: int, async_op: bool) -> list[Tensor]:
    out = _data(r, 5)
    _finish(dist.all_reduce(out, async_op=async_op))
    return [out]


def _finish(work: dist.Work | None) -> None:
    """An async handle: the outputs are theirs once ``wait()`` returned."""
    if work is not None:
        work.wait()


FORMS: dict[str, Callable[[int, int, bool], list[Tensor]]] = {
    "all_gather": _all_gather_list,
    "all_gather_into_tensor": lambda p, r, a: _gather_into(dist.all_gather_into_tensor, p, r, a),
    "all_gather_single": lambda p, r, a: _gather_into(dist.all_gather_single, p, r, a),
    "_all_gather_base": lambda p, r, a: _gather_into(dist._all_gather_base, p, r, a),
    "reduce_scatter": lambda p, r, a: _reduce_scatter_list(p, r, a, ReduceOp.SUM),
    "reduce_scatter_tensor": lambda p, r, a: _scatter_into(
        dist.reduce_scatter_tensor, p, r, a, ReduceOp.SUM
    ),
    "reduce_scatter_tensor(MAX)": lambda p, r, a: _scatter_into(
        dist.reduce_scatter_tensor, p, r, a, ReduceOp.MAX
    ),
    "reduce_scatter_single": lambda p, r, a: _scatter_into(
        dist.reduce_scatter_single, p, r, a, ReduceOp.SUM
    ),
    "_reduce_scatter_base": lambda p, r, a: _scatter_into(
        dist._reduce_scatter_base, p, r, a, ReduceOp.SUM
    ),
    "all_to_all": _all_to_all_list,
    "all_to_all_single": _all_to_all_even,
    "all_to_all_single(splits)": _all_to_all_uneven,
    "all_reduce": _all_reduce,
}


def run_forms() -> dict[str, list[Tensor] | str]:
    """Every form, blocking and with ``async_op=True``: its outputs, or the error it raised."""
    p, r = dist.get_world_size(), dist.get_rank()
    results: dict[str, list[Tensor] | str] = {}
    for name, form in FORMS.items():
        for async_op in (False, True):
            key = f"{name}{' async' if async_op else ''}"
            try:
                results[key] = form(p, r, async_op)
            except (RuntimeError, ValueError) as err:
                results[key] = f"{type(err).__name__}: {err}".splitlines()[0]
    return results


def _gloo_rank(rank: int, world_size: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        torch.save(run_forms(), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> None:
    """``python forms.py WORLD_SIZE PORT OUT``: run the forms on real gloo, save every rank's."""
    import torch.multiprocessing as mp

    world_size, port, out = int(argv[1]), int(argv[2]), argv[3]
    mp.spawn(_gloo_rank, args=(world_size, port, out), nprocs=world_size)
    torch.save([torch.load(f"{out}.{r}") for r in range(world_size)], out)


if __name__ == "__main__":
    import sys
    import warnings

    warnings.simplefilter("ignore", FutureWarning)  # the deprecated names are called on purpose
    main(sys.argv)
