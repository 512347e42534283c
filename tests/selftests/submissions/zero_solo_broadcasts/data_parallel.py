"""Owners shown by messages that never left the rank (graded as
``zero_decoy_broadcasts+zero_solo_broadcasts``: that attack's unsharded optimizer hidden in
a plain object, stepping every parameter on every rank): each owner broadcasts its
parameters' updated values in a group of one (itself alone), which completes at once, so the
broker saw each update sent once, by its owner, and no other rank received it. With the true
gradient only on each parameter's owner, the other ranks' own steps of it are wrong, so the
real values go from the owner to the others by sends, beside the solo broadcasts.
"""

from typing import Any

import torch
import torch.distributed as dist

from reference.data_parallel import *  # noqa: F403


def alone():
    """This rank's group of one (every rank makes every rank's, as new_group requires)."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return groups[dist.get_rank()]


class ShardedOptimizer(ShardedOptimizer):  # noqa: F405 (zero_decoy_broadcasts', hiding one)
    def step(self, closure: Any = None) -> None:
        if not hasattr(self._hidden, "alone"):
            self._hidden.alone = alone()
        for group, full in zip(self.param_groups, self._hidden.full.param_groups, strict=True):
            full.update(self._hyperparameters(group))
        self._hidden.full.step()  # every parameter, on every rank
        p, me = dist.get_world_size(), dist.get_rank()
        with torch.no_grad():
            for q, owner in self._owner.items():
                if owner == me:
                    dist.broadcast(q.detach().clone(), src=me, group=self._hidden.alone)
                    for other in range(p):
                        if other != me:
                            dist.send(q.detach().contiguous(), other)
                else:
                    got = torch.empty_like(q)
                    dist.recv(got, owner)
                    q.copy_(got)
