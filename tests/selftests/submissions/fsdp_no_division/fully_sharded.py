"""FullyShardedDataParallel leaves the SUM of the gradients over ranks, not their mean.

Every sharded and replicated gradient is p times the mean; the communication is right.
"""

import torch.distributed as dist

from reference import fully_sharded as _reference
from reference.fully_sharded import *  # noqa: F403


class FullyShardedDataParallel(_reference.FullyShardedDataParallel):
    def finish_gradient_synchronization(self) -> None:
        super().finish_gradient_synchronization()
        for param in self.module.parameters():
            param.grad.mul_(dist.get_world_size())  # the bug: the sum, as no division left it
