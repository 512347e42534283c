"""The arrived rows are taken to be expert-major when they are rank-major.

With two or more experts per rank and two or more ranks, an expert runs on rows meant for
another; with one expert per rank (E = p) or at p = 1 the orders coincide.
"""

import torch
from torch import Tensor

from reference import expert_parallel as _reference
from reference.expert_parallel import *  # noqa: F403


class ExpertParallelMoE(_reference.ExpertParallelMoE):
    def _run_experts(self, arrived: Tensor, sizes: Tensor) -> Tensor:
        # the bug: split as if rank 0's..(p-1)'s rows for expert 0 came first, then expert 1's
        by_expert = arrived.split(sizes.sum(0).tolist())
        outputs = [self.moe.experts[self.first + e](rows) for e, rows in enumerate(by_expert)]
        return torch.cat(outputs)
