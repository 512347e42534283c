"""Assignment: Megatron-style tensor parallelism for linear layers and the transformer MLP.

You may use the collectives of `torch.distributed`. `group` is a process group (`None`: the
default group); p = `dist.get_world_size(group)` and r = `dist.get_rank(group)`, the rank
inside the group, which picks the shard. Every rank of the group calls collectively. A
dimension that p does not divide raises `ValueError` naming it, e.g. "out_features=10 is not
divisible by the tensor-parallel size 4". The four region functions are autograd functions
(one collective forward or backward); each layer holds this rank's shard of a full one.

Graded (`grader list tensor_parallel`; points in tests/graded/grading.yaml), at p = 1, 2, 4:
full `nn.Linear` layers are sharded with your `from_linear`/`from_linears`, then one forward
and backward: the shard each rank holds, the output and the gradients of the input, weight
and bias must match the full layers in float64, within float32 rounding; each of the four
region functions forward and backward, on non-contiguous inputs; a dimension p does not
divide must raise `ValueError` naming it. `parallel_mlp_communication` (p = 2, 4): the MLP's
forward and its backward each make exactly one all-reduce, and no other operation.

Hints
    - Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models
      Using Model Parallelism", section 3 and figure 3 (the f and g operators).
    - A linear layer Y = X A^T + b, with A of shape (out_features, in_features), splits two
      ways. Column parallel: rank r holds rows [r*out/p, (r+1)*out/p) of A and b and computes
      that slice of Y's last dimension from the full X. Row parallel: rank r holds columns
      [r*in/p, (r+1)*in/p) of A, multiplies the matching slice of X's last dimension, and the
      partial results are summed over ranks. A column-parallel layer feeding a row-parallel
      one needs no communication in between.
    - Implement each region function as a `torch.autograd.Function` subclass (Megatron names
      them _CopyToModelParallelRegion, ...) whose `backward` returns one gradient per input of
      `forward` (None for `group`); each function below returns `YourFunction.apply(x, group)`.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed import ProcessGroup


def copy_to_parallel_region(x: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """Megatron's f. Forward: identity. Backward: all-reduce (sum) the gradient.

    Shape unchanged. Graded: forward and backward against one process, on non-contiguous
    inputs. Communication: one all-reduce in backward, none in forward.

    Hints
        X is used by every rank's branch, so dL/dX is the sum of the branches' contributions.
        Placed before a column-parallel layer.
    """
    raise NotImplementedError("tensor_parallel.copy_to_parallel_region: not implemented yet")


def reduce_from_parallel_region(x: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """Megatron's g. Forward: all-reduce (sum) over ranks. Backward: identity.

    Shape unchanged; `x` itself is left unchanged. Graded: forward and backward against one
    process, on non-contiguous inputs. Communication: one all-reduce in forward, none in
    backward.

    Hints
        Placed after a row-parallel layer to sum the partial products. All-reduce a copy, not
        `x` in place.
    """
    raise NotImplementedError("tensor_parallel.reduce_from_parallel_region: not implemented yet")


def gather_from_parallel_region(x: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """Forward: all-gather along the last dim, (..., n) -> (..., n*p), in rank order.

    Backward: keep this rank's slice [r*n, (r+1)*n) of the gradient's last dim. Graded:
    forward and backward against one process, on non-contiguous inputs. Communication: one
    all-gather in forward, none in backward.

    Hints
        `dist.all_gather` needs contiguous tensors; `torch.cat(..., dim=-1)` puts the pieces
        side by side.
    """
    raise NotImplementedError("tensor_parallel.gather_from_parallel_region: not implemented yet")


def scatter_to_parallel_region(x: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """Forward: keep this rank's slice of the last dim, (..., n) -> (..., n/p).

    `ValueError` if p does not divide n. Backward: all-gather the gradient along the last dim.
    Graded: forward and backward against one process, on non-contiguous inputs.
    Communication: none in forward, one all-gather in backward.

    Hints
        The mirror of `gather_from_parallel_region`: its forward is this one's backward.
    """
    raise NotImplementedError("tensor_parallel.scatter_to_parallel_region: not implemented yet")


class ColumnParallelLinear(nn.Module):
    """Linear layer with the output features split over the ranks of `group`.

    - `self.weight`: this rank's `(out_features // p, in_features)` shard, rows
      `[r*out/p, (r+1)*out/p)` of the full weight; `self.bias`: the same rows of the full bias
      (or None). `ValueError` if p does not divide `out_features`.
    - `from_linear(linear, gather_output=False, group=None)` shards a full `nn.Linear`
      (copies, keeping its dtype); `__init__` may initialise any deterministic way.
    - `forward(x)`: x `(..., in_features)`, complete on every rank -> `(..., out_features // p)`;
      with `gather_output=True`, all-gathered to `(..., out_features)`.

    Graded: the shard held, the output and the gradients of x, weight and bias against the full
    layer. Communication: one all-reduce of dL/dx in backward (plus the all-gather in forward
    if `gather_output`).

    Hints
        x -> copy_to_parallel_region -> local `F.linear` -> (gather_from_parallel_region).
        To initialise, draw a full `nn.Linear(in_features, out_features)` and keep your slice.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        group: ProcessGroup | None = None,
    ) -> None:
        raise NotImplementedError(
            "tensor_parallel.ColumnParallelLinear.__init__: not implemented yet"
        )

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, gather_output: bool = False, group: ProcessGroup | None = None
    ) -> ColumnParallelLinear:
        """This rank's shard of the full layer `linear` (copies, keeping its dtype)."""
        raise NotImplementedError(
            "tensor_parallel.ColumnParallelLinear.from_linear: not implemented yet"
        )

    def forward(self, x: Tensor) -> Tensor:
        raise NotImplementedError(
            "tensor_parallel.ColumnParallelLinear.forward: not implemented yet"
        )


class RowParallelLinear(nn.Module):
    """Linear layer with the input features split over the ranks of `group`.

    - `self.weight`: this rank's `(out_features, in_features // p)` shard, columns
      `[r*in/p, (r+1)*in/p)` of the full weight; `self.bias`: the full bias, replicated (or
      None). `ValueError` if p does not divide `in_features`.
    - `from_linear(linear, input_is_parallel=True, group=None)` shards a full `nn.Linear`
      (copies, keeping its dtype).
    - `forward(x)`: x `(..., in_features // p)`, this rank's slice (with
      `input_is_parallel=False`, x is `(..., in_features)` and is split first) ->
      `(..., out_features)`, identical on every rank; the bias added once, after the sum.

    Graded: the shard held, the output and the gradients of x, weight and bias against the full
    layer. Communication: one all-reduce of the output in forward.

    Hints
        x -> (scatter_to_parallel_region) -> local `F.linear` without bias ->
        reduce_from_parallel_region -> + bias. Adding the bias before the all-reduce would add
        it p times.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        group: ProcessGroup | None = None,
    ) -> None:
        raise NotImplementedError("tensor_parallel.RowParallelLinear.__init__: not implemented yet")

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, input_is_parallel: bool = True, group: ProcessGroup | None = None
    ) -> RowParallelLinear:
        """This rank's shard of the full layer `linear` (copies, keeping its dtype)."""
        raise NotImplementedError(
            "tensor_parallel.RowParallelLinear.from_linear: not implemented yet"
        )

    def forward(self, x: Tensor) -> Tensor:
        raise NotImplementedError("tensor_parallel.RowParallelLinear.forward: not implemented yet")


class ParallelMLP(nn.Module):
    """The transformer MLP fc2(GELU(fc1(x))), split as in Megatron (section 3, figure 3a).

    - `self.fc1`: ColumnParallelLinear(hidden_size, ffn_hidden_size, gather_output=False);
      `self.act`: nn.GELU() (exact, not tanh); `self.fc2`: RowParallelLinear(ffn_hidden_size,
      hidden_size, input_is_parallel=True).
    - `from_linears(fc1, fc2, group=None)` shards two full layers: fc1 by rows, fc2 by columns.
    - `forward(x)`: x `(..., hidden_size)` -> `(..., hidden_size)`, identical on every rank.

    Graded: the output and every gradient against the full MLP. Communication
    (`parallel_mlp_communication`): exactly one all-reduce in forward (fc2's g) and one in
    backward (fc1's f), each of a `(..., hidden_size)` tensor, and no other operation.

    Hints
        GELU is element-wise, so it runs on fc1's output slice without communication.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        bias: bool = True,
        group: ProcessGroup | None = None,
    ) -> None:
        raise NotImplementedError("tensor_parallel.ParallelMLP.__init__: not implemented yet")

    @classmethod
    def from_linears(
        cls, fc1: nn.Linear, fc2: nn.Linear, group: ProcessGroup | None = None
    ) -> ParallelMLP:
        """This rank's shard of fc2(GELU(fc1(x))); fc1 is sharded by rows, fc2 by columns."""
        raise NotImplementedError("tensor_parallel.ParallelMLP.from_linears: not implemented yet")

    def forward(self, x: Tensor) -> Tensor:
        raise NotImplementedError("tensor_parallel.ParallelMLP.forward: not implemented yet")
