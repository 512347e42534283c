"""One call of a collective on n elements in all, for ``grader bench``.

Made the same way for every implementation, so that the student's, the
reference's and torch's own collectives are measured on identical work, on
every rank of the bench's job (the graded cost tests make theirs on the
trusted side, from the secret seed: :mod:`grader.testkit.calls`). n is the
whole array (nccl-tests' convention): the tensor of a broadcast, reduce or
all-reduce; the concatenation of the pieces of the list-based ones.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from grader.protocol import OpName
from grader.testkit.calls import ROOT


def _data(key: str, rank: int, n: int, device: torch.device | str) -> torch.Tensor:
    """Benchmark data: random, different per rank; nothing is checked against it."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{key}/rank{rank}".encode()))
    return torch.randn(n, generator=generator).to(device)


# torch.distributed's own collectives, with the student API's signatures.
TORCH_COLLECTIVES = SimpleNamespace(
    broadcast=lambda tensor, src: dist.broadcast(tensor, src),
    reduce=lambda tensor, dst: dist.reduce(tensor, dst),
    all_reduce=lambda tensor: dist.all_reduce(tensor),
    scatter=lambda tensor, scatter_list, src: dist.scatter(tensor, scatter_list, src),
    gather=lambda tensor, gather_list, dst: dist.gather(tensor, gather_list, dst),
    all_gather=lambda tensor_list, tensor: dist.all_gather(tensor_list, tensor),
    reduce_scatter=lambda output, input_list: dist.reduce_scatter(output, input_list),
    all_to_all=lambda output_list, input_list: dist.all_to_all(output_list, input_list),
)


def collective_call(
    module: Any,
    function: str,
    rank: int,
    world_size: int,
    n: int,
    device: torch.device | str = "cpu",
) -> Callable[[], None]:
    """A call of ``module.function`` on n float32 elements (n divisible by the world size)."""
    piece = n // world_size
    fn = getattr(module, function)
    data = _data(f"costs/{function}", rank, n, device)
    pieces = [_data(f"costs/{function}/{r}", rank, piece, device) for r in range(world_size)]
    empty = [torch.empty(piece, device=device) for _ in range(world_size)]
    out = torch.empty(piece, device=device)
    work = data.clone()
    calls = {
        OpName.BROADCAST: lambda: fn(work, ROOT),
        OpName.REDUCE: lambda: fn(work, ROOT),
        OpName.ALL_REDUCE: lambda: fn(work),
        OpName.SCATTER: lambda: fn(out, pieces if rank == ROOT else None, ROOT),
        OpName.GATHER: lambda: fn(pieces[0], empty if rank == ROOT else None, ROOT),
        OpName.ALL_GATHER: lambda: fn(empty, pieces[0]),
        OpName.REDUCE_SCATTER: lambda: fn(out, pieces),
        OpName.ALL_TO_ALL: lambda: fn(empty, pieces),
    }
    return calls[function]
