"""An attack on what the combine carries: every rank holds a copy of every expert, so the
home rank computes its tokens' expert outputs itself, and the forward's combine all-to-all
sends zeros of the right size, its result dropped. Backward is the real one (the mirror
all-to-alls carry the outputs' gradients to the owners and the rows' gradients home), so the
outputs, the tokens' gradients and the experts' gradients are all right, and every
all-to-all has the reference's split sizes. But the combine carries no expert output.

The exchanges go through the module's own ``_all_to_all`` (the reference's, by
all_to_all_single): ``ep_decoy_combine+ep_own_all_to_all`` makes the same attack through the
student's own all-to-all of isend/irecv messages.
"""

import torch
from torch import Tensor

from reference import expert_parallel as _reference
from reference.expert_parallel import *  # noqa: F403


class _DecoyCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, outputs, local, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        _all_to_all(torch.zeros_like(outputs), send_splits, recv_splits, group)  # noqa: F405
        return local

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        back = _all_to_all(grad, recv_splits, send_splits, ctx.group)  # noqa: F405
        return back, None, None, None, None


class ExpertParallelMoE(_reference.ExpertParallelMoE):
    def forward(self, x: Tensor) -> Tensor:
        if self.p == 1:
            return super().forward(x)
        k, p, n = self.moe.top_k, self.p, self.per_rank
        experts, gates = self.moe.route(x)
        token = torch.arange(len(x)).repeat_interleave(k)
        expert, gate = experts.reshape(-1), gates.reshape(-1)
        counts = torch.bincount(expert, minlength=self.num_experts)
        kept = self._kept(_reference._exchange_counts(counts, self.group))
        order = _reference._first_pairs(expert, kept[self.rank])
        send_splits = kept[self.rank].view(p, n).sum(1).tolist()
        recv_splits = kept[:, self.first : self.first + n].sum(1).tolist()
        arrived = self._exchange(x[token[order]], send_splits, recv_splits)
        outputs = self._run_experts(arrived, kept[:, self.first : self.first + n])
        with torch.no_grad():  # the attack: the home rank runs the experts itself
            rows = x[token[order]]
            local = torch.stack(
                [self.moe.experts[int(e)](row) for e, row in zip(expert[order], rows, strict=True)]
            ) if len(rows) else rows.clone()
        returned = _DecoyCombine.apply(outputs, local, recv_splits, send_splits, self.group)
        return torch.zeros_like(x).index_add(0, token[order], gate[order, None] * returned)
