"""The capacity is computed from each rank's own tokens and applied to its own pairs.

Each rank keeps, of every expert's pairs, its first ceil(cf * k * T_r / E), instead of the
first C = ceil(cf * k * T / E) of all ranks' pairs in rank order. The counts are still
exchanged, so the all-to-alls agree; only the pairs kept are wrong.
"""

import math

import torch
from torch import Tensor

from reference import expert_parallel as _reference
from reference.expert_parallel import *  # noqa: F403


class ExpertParallelMoE(_reference.ExpertParallelMoE):
    def _kept(self, counts: Tensor) -> Tensor:
        if self.capacity_factor is None:
            return counts
        k, E = self.moe.top_k, self.num_experts
        # the bug: every rank's own tokens decide its own capacity
        tokens = [int(row.sum()) // k for row in counts]
        local = [math.ceil(self.capacity_factor * k * t / E) for t in tokens]
        return counts.minimum(torch.tensor(local)[:, None])
