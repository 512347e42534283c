"""finish_gradient_synchronization averages the router's gradients but never divides the
local experts' by p: each holds the sum of every rank's contributions (right at p = 1). The
outputs and every exchange are right.
"""

import torch.distributed as dist

from reference import expert_parallel as _reference
from reference.expert_parallel import *  # noqa: F403


class ExpertParallelMoE(_reference.ExpertParallelMoE):
    def finish_gradient_synchronization(self) -> None:
        for param in self.moe.router.parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)  # noqa: F405
            if self.p > 1:
                dist.all_reduce(param.grad, group=self.group)
            param.grad /= self.p
        # the bug: the local experts' gradients are left as the sum over ranks, not / p
