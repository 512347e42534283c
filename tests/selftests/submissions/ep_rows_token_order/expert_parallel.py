"""The dispatch sends the pairs' token rows in token order, not grouped by destination, with
the split sizes of the grouped order, and the combine adds them back in token order: rows
reach the wrong experts wherever a rank's pairs are not already sorted by expert.
"""

import torch

from reference import expert_parallel as R
from reference.expert_parallel import *  # noqa: F403


class ExpertParallelMoE(R.ExpertParallelMoE):
    def forward(self, x):
        k, p, n = self.moe.top_k, self.p, self.per_rank
        experts, gates = self.moe.route(x)
        token = torch.arange(len(x)).repeat_interleave(k)
        expert, gate = experts.reshape(-1), gates.reshape(-1)
        counts = torch.bincount(expert, minlength=self.num_experts)
        kept = self._kept(R._exchange_counts(counts, self.group))
        send_splits = kept[self.rank].view(p, n).sum(1).tolist()
        recv_splits = kept[:, self.first : self.first + n].sum(1).tolist()
        pairs = R._first_pairs(expert, kept[self.rank]).sort().values  # the bug: token order
        arrived = self._exchange(x[token[pairs]], send_splits, recv_splits)
        outputs = self._run_experts(arrived, kept[:, self.first : self.first + n])
        returned = self._exchange(outputs, recv_splits, send_splits)
        return torch.zeros_like(x).index_add(0, token[pairs], gate[pairs, None] * returned)
