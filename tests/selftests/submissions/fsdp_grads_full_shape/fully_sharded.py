"""The full gradient is all-reduced and each rank keeps its shard of it: right values, but
every rank receives every gradient in full (2(p-1)/p of the bytes, not (p-1)/p).
"""

import torch
import torch.distributed as dist

from reference.fully_sharded import *  # noqa: F403
from reference.fully_sharded import _Sharded


class _Slice:
    def __init__(self, work, padded, out):
        self.work, self.padded, self.out = work, padded, out

    def wait(self):
        self.work.wait()
        s, r = self.out.numel(), dist.get_rank()
        self.out.copy_(self.padded[r * s : (r + 1) * s])


def _start_reduce_scatter(self, full_grad):
    p = dist.get_world_size()
    padded = torch.zeros(self.param.numel() * p, dtype=torch.float32)
    padded[: self.numel] = full_grad.reshape(-1)
    work = dist.all_reduce(padded, async_op=True)  # the bug: all-reduce, not reduce-scatter
    self.grad = torch.empty(self.param.numel(), dtype=torch.float32)
    self.grad_work = _Slice(work, padded, self.grad)


_Sharded.start_reduce_scatter = _start_reduce_scatter
