"""The float32 shards are all-gathered and the full weight cast to the compute dtype after.

Values are right; a 16-bit model's gathers move twice the bytes they need.
"""

import torch
import torch.distributed as dist

from reference.fully_sharded import *  # noqa: F403
from reference.fully_sharded import _Sharded


def _start_gather(self):
    if self.full is not None or self.gather_work is not None:
        return
    shard = self.param.detach()  # the bug: not cast before the gather
    self.flat = torch.empty(shard.numel() * dist.get_world_size(), dtype=shard.dtype)
    self.gather_work = dist.all_gather_into_tensor(self.flat, shard, async_op=True)


def _wait_gather(self):
    if self.full is None:
        self.start_gather()
        self.gather_work.wait()
        self.full = self.flat[: self.numel].view(self.shape).to(self.compute_dtype)
        self.gather_work = self.flat = None
    return self.full


_Sharded.start_gather = _start_gather
_Sharded.wait_gather = _wait_gather
