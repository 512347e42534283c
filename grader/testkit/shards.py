"""The shard each rank of a tensor-parallel layer holds, and the words for a wrong one.

Shared by the tensor_parallel graded tests of the layers and of the MLP: the contract's
shard of a full ``nn.Linear`` (Megatron's column and row split), checked right after
``from_linear`` and before any forward, so that a shard split along the wrong dimension,
a bias of the wrong size, another rank's block or a lost dtype is named with the
dimension that is split and why, before it breaks a matmul in torch's own words. What a
rank's scenario returned of a layer is read into checked records (:class:`Held`,
:class:`Shard`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grader.launch.world import World
from grader.testkit.compare import check_unchanged, on_every_rank, require
from grader.testkit.observed import (
    kind,
    list_of,
    or_none,
    read_every_rank,
    read_field,
    read_fields,
    read_tensor,
)

HELD = ("linear_weight", "weight", "bias")
DTYPE_NAMES = frozenset(
    {"none"} | {str(v) for v in vars(torch).values() if isinstance(v, torch.dtype)}
)


def read_dtype_name(value: Any) -> str:
    """``value`` if the name of a torch dtype (``torch.float64``) or "none"; else ValueError."""
    if not isinstance(value, str) or value not in DTYPE_NAMES:
        raise ValueError(f"{kind(value)} where a dtype's name is due")
    return value


@dataclass(frozen=True)
class Held:
    """What a rank's layer held: its ``weight`` and ``bias`` (None: no such tensor), and the
    full layer's weight after ``from_linear`` sharded it (which must leave it as it was)."""

    linear_weight: Tensor
    weight: Tensor | None
    bias: Tensor | None

    @classmethod
    def read(cls, tree: dict[str, Any]) -> Held:
        """The record of the fields :data:`HELD` of ``tree``; ProtocolError unless tensors."""
        tensor = or_none(read_tensor)
        return cls(
            read_field(tree, "linear_weight", read_tensor),
            read_field(tree, "weight", tensor),
            read_field(tree, "bias", tensor),
        )

    def tensors(self) -> dict[str, Tensor | None]:
        """The layer's tensors by name."""
        return {"weight": self.weight, "bias": self.bias}


@dataclass(frozen=True)
class Shard:
    """A layer as ``from_linear`` built it (:class:`Held`), and the dtypes of the weight and
    the bias it built from a float64 layer."""

    held: Held
    float64_dtypes: tuple[str, ...]

    @classmethod
    def read(cls, tree: Any) -> Shard:
        """The record of ``tree``; ProtocolError unless it has exactly that structure."""
        read_fields(tree, (*HELD, "float64_dtypes"))
        dtypes = read_field(tree, "float64_dtypes", list_of(read_dtype_name, 2))
        return cls(Held.read(tree), dtypes)


def shards(returned: Sequence[Any], case: str) -> list[Shard]:
    """Every rank's :class:`Shard` (:func:`~grader.testkit.observed.read_every_rank`)."""
    return read_every_rank(returned, Shard.read, "tensor_parallel.shard", case)


def block(p: int, rank: int, n: int) -> slice:
    """Rank ``rank``'s block of ``n`` items split in ``p``: ``[rank*n/p, (rank+1)*n/p)``."""
    return slice(rank * n // p, (rank + 1) * n // p)


def split_rule(layer: str, p: int, shape: tuple[int, ...]) -> str:
    """What each rank of a ``layer`` holds, and why: the contract, said once for every message."""
    n_out, n_in = shape
    if layer == "ColumnParallelLinear":
        n = n_out // p
        return (
            f"ColumnParallelLinear splits the weight's rows (out_features={n_out}) across the "
            f"{p} ranks: rank r holds rows [r*{n}, (r+1)*{n}) of the full ({n_out}, {n_in}) "
            f"weight and the same {n} entries of the bias, so that it computes its {n} output "
            "features"
        )
    n = n_in // p
    return (
        f"RowParallelLinear splits the weight's columns (in_features={n_in}) across the {p} "
        f"ranks: rank r holds columns [r*{n}, (r+1)*{n}) of the full ({n_out}, {n_in}) weight, "
        "which multiply its slice of the input; the bias is not split (it is added once, after "
        "the all-reduce)"
    )


def shard_of(full: dict[str, Tensor], layer: str, p: int, rank: int) -> dict[str, Tensor]:
    """Rank ``rank``'s shard by the contract: ``weight[rows, cols]`` and the bias's rows."""
    n_out, n_in = full["weight"].shape
    if layer == "ColumnParallelLinear":
        rows = block(p, rank, n_out)
        return {"weight": full["weight"][rows], "bias": full["bias"][rows]}
    return {"weight": full["weight"][:, block(p, rank, n_in)], "bias": full["bias"]}


def check_shard(
    seen: Shard, full: dict[str, Tensor], layer: str, p: int, rank: int, by: str = ""
) -> None:
    """The shard ``from_linear`` kept: the contract's shape, values and dtype, or why not."""
    what = f"{by or layer + '.from_linear'} on {p} ranks"
    rule = split_rule(layer, p, tuple(full["weight"].shape))
    other = "ColumnParallelLinear" if layer == "RowParallelLinear" else "RowParallelLinear"
    for name, want in shard_of(full, layer, p, rank).items():
        got = seen.held.tensors()[name]
        require(isinstance(got, Tensor), f"{what}: the layer has no .{name} tensor")
        shape, wanted = tuple(got.shape), tuple(want.shape)
        hint = " (the full tensor, not this rank's shard)" if got.shape == full[name].shape else ""
        if name == "weight" and got.shape == shard_of(full, other, p, rank)["weight"].shape:
            hint = " (split along the wrong dimension)"
        require(
            shape == wanted, f"{what}: .{name} has shape {shape}, expected {wanted}{hint}: {rule}"
        )
        if torch.equal(got, want):
            continue
        owner = next(
            (s for s in range(p) if torch.equal(got, shard_of(full, layer, p, s)[name])), None
        )
        require(
            owner is None,
            f"{what}: .{name} holds rank {owner}'s shard, not rank {rank}'s: take the block of "
            f"this rank, r = dist.get_rank(group); {rule}",
        )
        raise AssertionError(f"{what}: .{name} is not this rank's shard of the full {name}: {rule}")
    dtypes = seen.float64_dtypes
    require(
        dtypes == ("torch.float64",) * 2,
        f"{what}: from a float64 nn.Linear it built a {dtypes[0].removeprefix('torch.')} "
        f"weight and a {dtypes[1].removeprefix('torch.')} bias: "
        "the shard keeps the layer's dtype (copy slices of its tensors; a new tensor or "
        "nn.Parameter is float32 by default)",
    )


def check_shards(
    world: World, layer: str, weight: Tensor, bias: Tensor, setting: str
) -> dict[str, Tensor]:
    """``from_linear`` alone on every rank, checked before any forward runs."""
    p, (key, value) = world.size, setting.split("=")
    args = [(layer, weight, bias, {key: value == "True"})] * p
    case = f"from_linear, {setting}"
    seen = shards(world.call(scenario="tensor_parallel.shard", args=args, case=case).returned, case)
    full = {"weight": weight, "bias": bias}

    def check(r: int) -> None:
        check_unchanged(
            seen[r].held.linear_weight, weight, f"{layer}.from_linear's argument weight"
        )
        check_shard(seen[r], full, layer, p, r)

    on_every_rank(p, check)
    return full


def check_shape(got: Tensor, want: tuple[int, ...], what: str, why: str) -> None:
    """The output's shape before its values: which shape, and why that one."""
    shape = tuple(got.shape)
    if shape == want:
        return
    stacked = len(shape) == len(want) and shape[0] != want[0] and shape[-1] != want[-1]
    hint = " (concatenated along dim 0: gather along the last dimension)" if stacked else ""
    raise AssertionError(f"{what}: output has shape {shape}, expected {want}{hint}: {why}")


def check_still_holds(seen: Held, full: dict[str, Tensor], layer: str, p: int, rank: int) -> None:
    """The layer that ran still holds this rank's shard, as ``from_linear`` built it."""
    held = seen.tensors()
    for name, want in shard_of(full, layer, p, rank).items():
        rule = split_rule(layer, p, tuple(full["weight"].shape))
        require(
            isinstance(held[name], Tensor) and torch.equal(held[name], want),
            f"{layer} on {p} ranks: .{name} is no longer this rank's shard: {rule}",
        )
