"""Assignment: Megatron-style tensor parallelism for linear layers and the transformer MLP.

You may use the collectives of `torch.distributed`. `group` is a process group (`None`: the
default group); p = `dist.get_world_size(group)` and r = `dist.get_rank(group)` (the rank
inside the group, not the world rank). Every rank of the group calls collectively.

Reading: Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models
Using Model Parallelism", section 3 and figure 3 (the f and g operators).

A linear layer Y = X A^T + b, with A of shape (out_features, in_features), splits two ways:
- column parallel: rank r holds rows [r*out/p, (r+1)*out/p) of A and b and computes that slice
  of Y's last dimension from the full X;
- row parallel: rank r holds columns [r*in/p, (r+1)*in/p) of A, multiplies the matching slice
  of X's last dimension, and the partial results are summed over ranks.
A column-parallel layer feeding a row-parallel one needs no communication in between.

Pitfalls: the row-parallel bias must be added once, after the sum (not p times); a dimension
that p does not divide raises `ValueError` naming it, e.g. "out_features=10 is not divisible
by the tensor-parallel size 4"; shards are taken with the group's rank.

Graded (`grader list tensor_parallel`; points in tests/graded/grading.yaml), at p = 1, 2, 4:
full `nn.Linear` layers are sharded with your `from_linear`/`from_linears`, then one forward
and backward: the shard each rank holds, the output and the gradients of the input, weight
and bias must match the full layers in float64, within float32 rounding; each of the four
region functions forward and backward, on non-contiguous inputs; a dimension p does not
divide must raise `ValueError` naming it. `parallel_mlp_communication` (p = 2, 4): the MLP's
forward and its backward each make exactly one all-reduce, and no other operation.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed import ProcessGroup

# Autograd functions. Implement each as a `torch.autograd.Function` subclass (Megatron names
# them _CopyToModelParallelRegion, ...) whose `backward` returns one gradient per input of
# `forward` (None for `group`); the functions below call `YourFunction.apply(x, group)`.


def copy_to_parallel_region(x: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """Megatron's f. Forward: identity. Backward: all-reduce (sum) the gradient.

    X is used by every rank's branch, so dL/dX is the sum of the branches' contributions.
    Placed before a column-parallel layer. Shape unchanged.
    """
    raise NotImplementedError("copy_to_parallel_region")


def reduce_from_parallel_region(x: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """Megatron's g. Forward: all-reduce (sum) over ranks. Backward: identity.

    Placed after a row-parallel layer to sum the partial products. Shape unchanged. Do not
    modify `x` in place: all-reduce a copy.
    """
    raise NotImplementedError("reduce_from_parallel_region")


def gather_from_parallel_region(x: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """Forward: all-gather along the last dim, (..., n) -> (..., n*p), rank order.

    Backward: keep this rank's slice [r*n, (r+1)*n) of the gradient's last dim.
    """
    raise NotImplementedError("gather_from_parallel_region")


def scatter_to_parallel_region(x: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """Forward: keep this rank's slice of the last dim, (..., n) -> (..., n/p); `ValueError`
    if p does not divide n. Backward: all-gather the gradient along the last dim.
    """
    raise NotImplementedError("scatter_to_parallel_region")


class ColumnParallelLinear(nn.Module):
    """Linear layer with the output features split over the ranks of `group`.

    `self.weight`: this rank's `(out_features // p, in_features)` shard, rows
    `[r*out/p, (r+1)*out/p)` of the full weight; `self.bias`: the same rows of the full bias
    (or None). Raises `ValueError` if p does not divide `out_features`.

    Forward: x (..., in_features), complete on every rank -> copy_to_parallel_region -> local
    `F.linear` -> (..., out_features // p); with `gather_output=True`, all-gathered to
    (..., out_features). Communication: one all-reduce of dL/dx in backward (plus the
    all-gather in forward if `gather_output`). Weight init: any deterministic scheme, e.g.
    draw a full `nn.Linear(in_features, out_features)` and keep your slice.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        group: ProcessGroup | None = None,
    ) -> None:
        raise NotImplementedError("ColumnParallelLinear.__init__")

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, gather_output: bool = False, group: ProcessGroup | None = None
    ) -> ColumnParallelLinear:
        """This rank's shard of the full layer `linear` (copies, keeping its dtype)."""
        raise NotImplementedError("ColumnParallelLinear.from_linear")

    def forward(self, x: Tensor) -> Tensor:
        raise NotImplementedError("ColumnParallelLinear.forward")


class RowParallelLinear(nn.Module):
    """Linear layer with the input features split over the ranks of `group`.

    `self.weight`: this rank's `(out_features, in_features // p)` shard, columns
    `[r*in/p, (r+1)*in/p)` of the full weight; `self.bias`: the full bias, replicated (or
    None). Raises `ValueError` if p does not divide `in_features`.

    Forward: x (..., in_features // p), this rank's slice (with `input_is_parallel=False`,
    x is (..., in_features) and is first split with scatter_to_parallel_region) -> local
    `F.linear` without bias -> reduce_from_parallel_region -> + bias -> (..., out_features),
    identical on every rank. Communication: one all-reduce of the output in forward.
    Pitfall: adding the bias before the all-reduce would add it p times.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        group: ProcessGroup | None = None,
    ) -> None:
        raise NotImplementedError("RowParallelLinear.__init__")

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, input_is_parallel: bool = True, group: ProcessGroup | None = None
    ) -> RowParallelLinear:
        """This rank's shard of the full layer `linear` (copies, keeping its dtype)."""
        raise NotImplementedError("RowParallelLinear.from_linear")

    def forward(self, x: Tensor) -> Tensor:
        raise NotImplementedError("RowParallelLinear.forward")


class ParallelMLP(nn.Module):
    """The transformer MLP fc2(GELU(fc1(x))), split as in Megatron (section 3, figure 3a).

    `self.fc1`: ColumnParallelLinear(hidden_size, ffn_hidden_size, gather_output=False);
    `self.act`: nn.GELU() (exact, not tanh); `self.fc2`: RowParallelLinear(ffn_hidden_size,
    hidden_size, input_is_parallel=True). GELU is element-wise, so it runs on fc1's output
    slice without communication. x (..., hidden_size) -> (..., hidden_size) on every rank.

    Communication: exactly one all-reduce in forward (fc2's g) and one in backward (fc1's f),
    each of a (..., hidden_size) tensor; no all-gather.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        bias: bool = True,
        group: ProcessGroup | None = None,
    ) -> None:
        raise NotImplementedError("ParallelMLP.__init__")

    @classmethod
    def from_linears(
        cls, fc1: nn.Linear, fc2: nn.Linear, group: ProcessGroup | None = None
    ) -> ParallelMLP:
        """This rank's shard of fc2(GELU(fc1(x))); fc1 is sharded by rows, fc2 by columns."""
        raise NotImplementedError("ParallelMLP.from_linears")

    def forward(self, x: Tensor) -> Tensor:
        raise NotImplementedError("ParallelMLP.forward")
