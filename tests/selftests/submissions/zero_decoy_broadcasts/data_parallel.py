"""An attack on the owners the broker sees: ``ShardedOptimizer`` steps every parameter with
an unsharded optimizer hidden in a plain object, and also makes the reference's broadcasts,
each from its owner, of a copy whose result it drops. With the same gradients everywhere the
broker sees ZeRO-1's messages and the steps are right. With the true gradient only on each
parameter's owner, a rank's own steps of the others' parameters are wrong, and the state test
fails.
"""

from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from reference import data_parallel as _reference
from reference.data_parallel import *  # noqa: F403


class ShardedOptimizer(_reference.ShardedOptimizer):
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = {**self._hyperparameters(self.param_groups[-1])}
        group["params"] = self.param_groups[-1]["params"]
        if not hasattr(self, "_hidden"):
            self._hidden = SimpleNamespace(
                full=self._optimizer_cls([group], **self._optimizer_kwargs)
            )
        else:
            self._hidden.full.add_param_group(group)

    def step(self, closure: Any = None) -> None:
        for group, full in zip(self.param_groups, self._hidden.full.param_groups, strict=True):
            full.update(self._hyperparameters(group))
        self._hidden.full.step()  # every parameter, on every rank
        with torch.no_grad():
            for q, owner in self._owner.items():
                dist.broadcast(q.detach().clone(), src=owner)  # a decoy: the result is dropped
