"""ShardedOptimizer's add_param_group, after construction, only extends self.param_groups.

The group given to the constructor is sharded as in the reference; a group added later never
gets owners and never reaches the local optimizer, so no rank ever updates its parameters.
"""

from typing import Any

import torch
import torch.distributed as dist

from reference import data_parallel as _reference
from reference.data_parallel import *  # noqa: F403


class ShardedOptimizer(_reference.ShardedOptimizer):
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._local is None:
            super().add_param_group(param_group)
        else:  # the bug: the new group is neither sharded nor given to the local optimizer
            torch.optim.Optimizer.add_param_group(self, param_group)

    def step(self, closure=None):
        for group, local_group in zip(self.param_groups, self._local.param_groups):
            local_group.update(self._hyperparameters(group))
        self._local.step()
        with torch.no_grad():
            for p, owner in self._owner.items():
                dist.broadcast(p, src=owner)
