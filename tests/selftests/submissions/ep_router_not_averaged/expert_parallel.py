"""finish_gradient_synchronization never all-reduces the router's gradients.

Each rank's router keeps the gradient of its own tokens (right at p = 1); the experts'
gradients are right.
"""

from reference import expert_parallel as _reference
from reference.expert_parallel import *  # noqa: F403


class ExpertParallelMoE(_reference.ExpertParallelMoE):
    def finish_gradient_synchronization(self) -> None:
        # the bug: no all-reduce (and no / p) of the router's gradients
        for expert in self.moe.experts[self.first : self.first + self.per_rank]:
            for param in expert.parameters():
                if param.grad is not None:
                    param.grad /= self.p
