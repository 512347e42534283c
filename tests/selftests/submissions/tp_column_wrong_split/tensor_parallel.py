"""ColumnParallelLinear splits the weight along its columns (in_features), not its rows.

Each rank's weight is (out_features, in_features/p): the forward's matmul cannot work,
and torch says "mat1 and mat2 shapes cannot be multiplied". The bias is split right.
"""

import torch
from torch import nn

from reference import tensor_parallel as _reference
from reference.tensor_parallel import *  # noqa: F403


class ColumnParallelLinear(_reference.ColumnParallelLinear):
    def _load_shard(self, linear: nn.Linear) -> None:
        p, r = self.tp_size, self.tp_rank
        # the bug: dim=1 is in_features; a column-parallel layer splits dim 0
        self.weight = nn.Parameter(torch.chunk(linear.weight.detach(), p, dim=1)[r].clone())
        self.bias = nn.Parameter(torch.chunk(linear.bias.detach(), p)[r].clone())
