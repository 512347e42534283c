"""An attack on the optimizer-state bound: ``ShardedOptimizer`` steps every parameter with an
unsharded optimizer hidden in a plain object, and keeps a decoy holding 1/p of the state
where a rank-side measurement would look. Every rank has the same gradients, so its steps are
right with no message at all. But the broker saw no rank send any parameter's update: no
rank owns anything, and the state test fails.
"""

from types import SimpleNamespace
from typing import Any

import torch

from reference import data_parallel as _reference
from reference.data_parallel import *  # noqa: F403


class ShardedOptimizer(_reference.ShardedOptimizer):
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)  # the decoy: the reference's 1/p local optimizer
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
        own = [q for g in self._local.param_groups for q in g["params"]]
        saved = [q.detach().clone() for q in own]
        self._local.step()  # the decoy's state fills in, 1/p of the whole
        with torch.no_grad():
            for q, value in zip(own, saved, strict=True):
                q.copy_(value)
        self._hidden.full.step()  # every parameter, on every rank
