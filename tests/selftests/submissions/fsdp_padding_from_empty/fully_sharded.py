"""The flat gradient is padded from ``torch.empty``, not ``torch.zeros``: whatever the memory
held is reduce-scattered into the padding of the last shard. Only the padding is wrong, and
only where p does not divide a parameter's size.
"""

import torch
import torch.distributed as dist

from reference.fully_sharded import *  # noqa: F403
from reference.fully_sharded import _Sharded


def _start_reduce_scatter(self, full_grad):
    p = dist.get_world_size()
    # the bug: the padding is not zeroed; torch.empty leaves whatever the memory held, which
    # this stand-in makes certain (0.5) so that the verdict does not depend on the allocator
    padded = torch.full((self.param.numel() * p,), 0.5, dtype=torch.float32)
    padded[: self.numel] = full_grad.reshape(-1)
    self.grad = torch.empty(self.param.numel(), dtype=torch.float32)
    self.grad_work = dist.reduce_scatter_tensor(self.grad, padded, async_op=True)


_Sharded.start_reduce_scatter = _start_reduce_scatter
