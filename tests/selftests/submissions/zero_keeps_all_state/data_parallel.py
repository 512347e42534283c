"""An attack on the optimizer-state promise: every rank keeps the whole AdamW state and steps
every parameter itself, then broadcasts each parameter from its owner, in the world group,
as the reference does. The owners the broker sees are right, and so are the values (an
owner's broadcast overwrites what a rank computed from a gradient it did not have); only
the rank's memory, as the kernel counts it, shows the whole state.
"""

from typing import Any

import torch
import torch.distributed as dist

from reference import data_parallel as _reference
from reference.data_parallel import *  # noqa: F403


class ShardedOptimizer(_reference.ShardedOptimizer):
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        whole = {**self._hyperparameters(group), "params": list(group["params"])}
        if getattr(self, "_whole", None) is None:  # the bug: every parameter's state
            self._whole = self._optimizer_cls([whole], **self._optimizer_kwargs)
        else:
            self._whole.add_param_group(whole)

    def step(self, closure=None):
        for group, mine in zip(self.param_groups, self._whole.param_groups, strict=True):
            mine.update(self._hyperparameters(group))
        self._whole.step()
        with torch.no_grad():
            works = [dist.broadcast(p, src=o, async_op=True) for p, o in self._owner.items()]
            for work in works:
                work.wait()
