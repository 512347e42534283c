"""Tensor (intra-layer) model parallelism in the style of Megatron-LM.

Reference solution of `assignments/tensor_parallel.py`, after Shoeybi et al. 2019,
"Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism".

A linear layer Y = X A^T + b is split across the p ranks of `group` in one of two ways:

- column parallel: each rank holds a block of rows of A (output features) and computes its
  slice of Y; the input X must be complete on every rank.
- row parallel: each rank holds a block of columns of A (input features), multiplies its slice
  of X, and the partial products are summed with an all-reduce.

Chaining a column-parallel layer into a row-parallel one (`ParallelMLP`) needs no communication
in between: the whole MLP costs one all-reduce in forward and one in backward. The collectives
live in four autograd functions; Megatron's paper calls the first two f and g.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx
from torch.distributed import ProcessGroup


def _divide(size: int, p: int, name: str) -> int:
    if size % p != 0:
        raise ValueError(f"{name}={size} is not divisible by the tensor-parallel size {p}")
    return size // p


def _all_reduce(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Sum over the ranks of `group`, into a new tensor (the input is left unchanged)."""
    if dist.get_world_size(group) == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def _split_last_dim(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """This rank's slice of the last dimension."""
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    n = _divide(x.size(-1), p, "x.size(-1)")
    return x.narrow(-1, rank * n, n).contiguous()


def _gather_last_dim(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """The ranks' tensors concatenated along the last dimension, in rank order."""
    p = dist.get_world_size(group)
    if p == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(p)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


class _CopyToModelParallelRegion(torch.autograd.Function):
    """Megatron's f: identity in forward; in backward, the input's gradient is the sum of the
    gradients each rank's branch produced, so it is all-reduced."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, group: ProcessGroup | None) -> Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """Megatron's g: all-reduce in forward (sum of partial products); identity in backward,
    since every rank's partial sum contributes to the output with weight 1."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, group: ProcessGroup | None) -> Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """All-gather along the last dimension in forward; in backward, keep this rank's slice."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, group: ProcessGroup | None) -> Tensor:
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return _split_last_dim(grad, ctx.group), None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dimension in forward; all-gather in backward."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, group: ProcessGroup | None) -> Tensor:
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return _gather_last_dim(grad, ctx.group), None


def copy_to_parallel_region(x: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """Identity forward, all-reduce backward (Megatron's f)."""
    return _CopyToModelParallelRegion.apply(x, group)


def reduce_from_parallel_region(x: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """All-reduce forward, identity backward (Megatron's g)."""
    return _ReduceFromModelParallelRegion.apply(x, group)


def gather_from_parallel_region(x: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """All-gather along the last dim forward, split backward."""
    return _GatherFromModelParallelRegion.apply(x, group)


def scatter_to_parallel_region(x: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """Split along the last dim forward, all-gather backward."""
    return _ScatterToModelParallelRegion.apply(x, group)


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A's rows (output features) split: rank r holds rows
    [r*out/p, (r+1)*out/p) of the weight and of the bias, and computes that slice of Y.

    A freshly constructed layer draws the full weight exactly as `nn.Linear` does and keeps its
    slice (Megatron's `_initialize_affine_weight_cpu`): with the same seed on every rank, the
    shards form one `nn.Linear(in_features, out_features)`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        group: ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.group = gather_output, group
        self.tp_rank, self.tp_size = dist.get_rank(group), dist.get_world_size(group)
        self.output_size_per_partition = _divide(out_features, self.tp_size, "out_features")
        self._load_shard(nn.Linear(in_features, out_features, bias=bias))

    def _load_shard(self, linear: nn.Linear) -> None:
        rows = slice(
            self.tp_rank * self.output_size_per_partition,
            (self.tp_rank + 1) * self.output_size_per_partition,
        )
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        bias = None if linear.bias is None else nn.Parameter(linear.bias.detach()[rows].clone())
        self.register_parameter("bias", bias)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, gather_output: bool = False, group: ProcessGroup | None = None
    ) -> ColumnParallelLinear:
        """This rank's shard of `linear`. Built on the meta device first: no random draws."""
        with torch.device("meta"):
            layer = cls(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                gather_output=gather_output,
                group=group,
            )
        layer._load_shard(linear)
        return layer

    def forward(self, x: Tensor) -> Tensor:
        """(..., in_features) -> (..., out_features/p), or (..., out_features) if gathered."""
        y = F.linear(copy_to_parallel_region(x, self.group), self.weight, self.bias)
        return gather_from_parallel_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A's columns (input features) split: rank r holds columns
    [r*in/p, (r+1)*in/p) of the weight and multiplies the matching slice of X; the partial
    products are all-reduced. The bias is replicated and added once, after the reduction
    (added before it, it would be counted p times).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        group: ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.group = input_is_parallel, group
        self.tp_rank, self.tp_size = dist.get_rank(group), dist.get_world_size(group)
        self.input_size_per_partition = _divide(in_features, self.tp_size, "in_features")
        self._load_shard(nn.Linear(in_features, out_features, bias=bias))

    def _load_shard(self, linear: nn.Linear) -> None:
        cols = slice(
            self.tp_rank * self.input_size_per_partition,
            (self.tp_rank + 1) * self.input_size_per_partition,
        )
        self.weight = nn.Parameter(linear.weight.detach()[:, cols].clone())
        bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        self.register_parameter("bias", bias)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, input_is_parallel: bool = True, group: ProcessGroup | None = None
    ) -> RowParallelLinear:
        """This rank's shard of `linear`. Built on the meta device first: no random draws."""
        with torch.device("meta"):
            layer = cls(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                input_is_parallel=input_is_parallel,
                group=group,
            )
        layer._load_shard(linear)
        return layer

    def forward(self, x: Tensor) -> Tensor:
        """(..., in_features/p), or (..., in_features) if not input_is_parallel -> (..., out)."""
        if not self.input_is_parallel:
            x = scatter_to_parallel_region(x, self.group)
        y = reduce_from_parallel_region(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class ParallelMLP(nn.Module):
    """fc2(GELU(fc1(x))) with fc1 column parallel and fc2 row parallel (Megatron, section 3).

    GELU is element-wise, so it applies to fc1's output slice without communication; fc2
    consumes that slice directly. Per forward: one all-reduce (fc2's g) of the output,
    (..., hidden_size); per backward: one all-reduce (fc1's f) of the input's gradient.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        bias: bool = True,
        group: ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(
            hidden_size, ffn_hidden_size, bias, gather_output=False, group=group
        )
        self.act = nn.GELU()
        self.fc2 = RowParallelLinear(
            ffn_hidden_size, hidden_size, bias, input_is_parallel=True, group=group
        )

    @classmethod
    def from_linears(
        cls, fc1: nn.Linear, fc2: nn.Linear, group: ProcessGroup | None = None
    ) -> ParallelMLP:
        """This rank's shard of the MLP fc2(GELU(fc1(x)))."""
        if fc1.out_features != fc2.in_features:
            raise ValueError(
                f"fc1.out_features={fc1.out_features} != fc2.in_features={fc2.in_features}"
            )
        with torch.device("meta"):
            mlp = cls(fc1.in_features, fc1.out_features, group=group)
        mlp.fc1 = ColumnParallelLinear.from_linear(fc1, gather_output=False, group=group)
        mlp.fc2 = RowParallelLinear.from_linear(fc2, input_is_parallel=True, group=group)
        return mlp

    def forward(self, x: Tensor) -> Tensor:
        """(..., hidden_size) -> (..., hidden_size), complete on every rank."""
        return self.fc2(self.act(self.fc1(x)))
