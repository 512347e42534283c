"""The combine adds the returned rows to the tokens in the order they were sent (sorted by
expert), not back at their tokens' positions.

Every output row goes to the wrong token unless the tokens were already sorted by expert.
"""

import torch
from torch import Tensor

from reference import expert_parallel as _reference
from reference.expert_parallel import *  # noqa: F403


class ExpertParallelMoE(_reference.ExpertParallelMoE):
    def forward(self, x: Tensor) -> Tensor:
        k, p, n = self.moe.top_k, self.p, self.per_rank
        experts, gates = self.moe.route(x)
        token = torch.arange(len(x)).repeat_interleave(k)
        expert, gate = experts.reshape(-1), gates.reshape(-1)
        counts = torch.bincount(expert, minlength=self.num_experts)
        kept = self._kept(_exchange_counts(counts, self.group))  # noqa: F405
        order = _first_pairs(expert, kept[self.rank])  # noqa: F405
        send_splits = kept[self.rank].view(p, n).sum(1).tolist()
        recv_splits = kept[:, self.first : self.first + n].sum(1).tolist()
        arrived = self._exchange(x[token[order]], send_splits, recv_splits)
        outputs = self._run_experts(arrived, kept[:, self.first : self.first + n])
        returned = self._exchange(outputs, recv_splits, send_splits)
        # the bug: the returned rows follow `order`, but are added as if in pair order
        home = token[: len(order)]
        return torch.zeros_like(x).index_add(0, home, gate[: len(order), None] * returned)
