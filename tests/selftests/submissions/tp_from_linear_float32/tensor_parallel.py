"""ColumnParallelLinear.from_linear copies its shard into new float32 parameters.

A float64 layer's shard comes out float32: the docstring promises the layer's dtype is
kept. Every float32 layer is right, so only the shard check of a float64 layer tells.
"""

import torch
from torch import nn

from reference import tensor_parallel as _reference
from reference.tensor_parallel import *  # noqa: F403


class ColumnParallelLinear(_reference.ColumnParallelLinear):
    def _load_shard(self, linear: nn.Linear) -> None:
        n, r = self.output_size_per_partition, self.tp_rank
        # the bug: torch.empty is float32 whatever the layer's dtype
        self.weight = nn.Parameter(torch.empty(n, self.in_features))
        self.bias = nn.Parameter(torch.empty(n))
        with torch.no_grad():
            self.weight.copy_(linear.weight[r * n : (r + 1) * n])
            self.bias.copy_(linear.bias[r * n : (r + 1) * n])
