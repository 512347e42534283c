"""RowParallelLinear adds its bias on every rank before the all-reduce.

The output is off by (p-1) x bias (right at p = 1); the gradients are right, since the
reduction's backward is the identity. ParallelMLP uses this RowParallelLinear for fc2.
"""

import torch.nn.functional as F
from torch import Tensor

from reference import tensor_parallel as _reference
from reference.tensor_parallel import *  # noqa: F403


class RowParallelLinear(_reference.RowParallelLinear):
    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = scatter_to_parallel_region(x, self.group)  # noqa: F405
        # the bug: the bias joins every rank's partial product, so it is summed p times
        return reduce_from_parallel_region(F.linear(x, self.weight, self.bias), self.group)  # noqa: F405


class ParallelMLP(_reference.ParallelMLP):
    @classmethod
    def from_linears(cls, fc1, fc2, group=None):
        mlp = super().from_linears(fc1, fc2, group=group)
        mlp.fc2 = RowParallelLinear.from_linear(fc2, input_is_parallel=True, group=group)
        return mlp
