"""Gradients are reduce-scattered in the compute dtype (float16) and cast to float32 after.

Values are within 16-bit rounding; the reduce-scatter carries 16-bit gradients: the sum over
ranks is rounded in 16 bits.
"""

import torch
import torch.distributed as dist

from reference.fully_sharded import *  # noqa: F403
from reference.fully_sharded import _Sharded


class _Later:
    """The float16 result, cast to float32 when waited for."""

    def __init__(self, work, half, out):
        self.work, self.half, self.out = work, half, out

    def wait(self):
        self.work.wait()
        self.out.copy_(self.half)


def _start_reduce_scatter(self, full_grad):
    p = dist.get_world_size()
    padded = torch.zeros(self.param.numel() * p, dtype=self.compute_dtype)  # the bug
    padded[: self.numel] = full_grad.reshape(-1)
    half = torch.empty(self.param.numel(), dtype=self.compute_dtype)
    work = dist.reduce_scatter_tensor(half, padded, async_op=True)
    self.grad = torch.empty(self.param.numel(), dtype=torch.float32)
    self.grad_work = _Later(work, half, self.grad)


_Sharded.start_reduce_scatter = _start_reduce_scatter
