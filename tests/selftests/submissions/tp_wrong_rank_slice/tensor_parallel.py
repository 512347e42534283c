"""ColumnParallelLinear keeps the next rank's rows: rank r holds block (r + 1) mod p.

Shapes are right, the values are another rank's shard (a rank counted from 1, or the
world rank of another group).
"""

from torch import nn

from reference import tensor_parallel as _reference
from reference.tensor_parallel import *  # noqa: F403


class ColumnParallelLinear(_reference.ColumnParallelLinear):
    def _load_shard(self, linear: nn.Linear) -> None:
        n, r = self.output_size_per_partition, (self.tp_rank + 1) % self.tp_size  # the bug
        self.weight = nn.Parameter(linear.weight.detach()[r * n : (r + 1) * n].clone())
        self.bias = nn.Parameter(linear.bias.detach()[r * n : (r + 1) * n].clone())
