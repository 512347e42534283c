"""ShardedOptimizer steps the constructor's param group with the optimizer's defaults.

The local optimizer is built from the first group's bare parameter list, and step() does not
copy the groups' settings over: the first group's own settings (lr, momentum, ...) are lost.
Groups added later keep theirs, as in the reference.
"""

from typing import Any

import torch
import torch.distributed as dist

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
        if self._local is None:  # the bug: the group's own settings are dropped
            self._local = self._optimizer_cls([{"params": local_params}], **self._optimizer_kwargs)
        else:
            self._local.add_param_group({**self._hyperparameters(group), "params": local_params})

    def step(self, closure=None):
        self._local.step()  # and the settings are never copied from self.param_groups
        with torch.no_grad():
            for p, owner in self._owner.items():
                dist.broadcast(p, src=owner)
