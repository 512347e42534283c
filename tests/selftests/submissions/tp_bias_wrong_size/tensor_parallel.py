"""ColumnParallelLinear slices its bias with the input features' partition size.

The weight's rows are right; the bias gets in_features/p entries instead of
out_features/p, so adding it to the output cannot broadcast.
"""

from torch import nn

from reference import tensor_parallel as _reference
from reference.tensor_parallel import *  # noqa: F403


class ColumnParallelLinear(_reference.ColumnParallelLinear):
    def _load_shard(self, linear: nn.Linear) -> None:
        super()._load_shard(linear)
        n, r = self.in_features // self.tp_size, self.tp_rank  # the bug: out_features
        self.bias = nn.Parameter(linear.bias.detach()[r * n : (r + 1) * n].clone())
