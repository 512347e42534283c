"""ShardedOptimizer builds its local optimizer from a bare list of this rank's parameters.

A rank that owns none of the first group's parameters passes an empty list, and the
optimizer's constructor raises "optimizer got an empty parameter list". With at least one
parameter per rank in the first group, all is the reference's.
"""

from typing import Any

import torch

from reference import data_parallel as _reference
from reference.data_parallel import *  # noqa: F403


class ShardedOptimizer(_reference.ShardedOptimizer):
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        torch.optim.Optimizer.add_param_group(self, param_group)
        group = self.param_groups[-1]
        local_params = []
        for p in group["params"]:
            owner = min(range(len(self._load)), key=self._load.__getitem__)
            self._owner[p] = owner
            self._load[owner] += p.numel()
            if owner == self._rank:
                local_params.append(p)
        if self._local is None:  # the bug: an empty list on a rank that owns nothing yet
            self._local = self._optimizer_cls(local_params, **self._optimizer_kwargs)
        else:
            self._local.add_param_group({**self._hyperparameters(group), "params": local_params})
