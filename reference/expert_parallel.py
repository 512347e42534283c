"""Expert parallelism: a mixture-of-experts layer whose experts are spread over the ranks.

Reference solution of `assignments/expert_parallel.py`, after Lepikhin et al. 2020,
"GShard: Scaling Giant Models with Conditional Computation and Automatic Sharding", and
Fedus et al. 2021, "Switch Transformers: Scaling to Trillion Parameter Models with Simple
and Efficient Sparsity" (capacity factor, section 2.2).

Rank r holds experts [r*E/p, (r+1)*E/p) and a copy of the router. Every rank routes its own
tokens, and one forward is four steps:

1. counts: every rank tells every other how many of its tokens go to each expert, so that
   each side of the next all-to-all knows how many rows it sends and receives;
2. dispatch: the token rows, sorted by expert, go to the ranks that own their experts, in
   one all-to-all whose split sizes differ from rank to rank (and may be zero);
3. experts: the rows that arrived (grouped by source rank) are regrouped by local expert,
   run through it, and put back in arrival order;
4. combine: the outputs go home in the mirror all-to-all (the splits swapped), where each
   is weighted by its gate and added to its token's output.

Backward is the same road in reverse: the gradient of an all-to-all is the all-to-all with
the splits swapped. The gates never leave their rank, so the router's gradient is local.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx
from torch.distributed import ProcessGroup

from grader.scenarios.expert_parallel import MoE  # the one-process layer of the assignment

__all__ = ["ExpertParallelMoE", "MoE"]


def _all_to_all(
    x: Tensor, send_splits: list[int], recv_splits: list[int], group: ProcessGroup | None
) -> Tensor:
    """Rows ``send_splits[j]`` of ``x`` (in order) to rank j; ``recv_splits[i]`` rows from i."""
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """An all-to-all of rows with uneven splits; its backward is the all-to-all with the
    splits swapped (each row's gradient goes back where the row came from)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        group: ProcessGroup | None,
    ) -> Tensor:
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return _all_to_all(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        send_splits, recv_splits = ctx.splits
        return _all_to_all(grad, recv_splits, send_splits, ctx.group), None, None, None


def _exchange_counts(counts: Tensor, group: ProcessGroup | None) -> Tensor:
    """Every rank's per-expert counts, ``[p, E]``: row i is rank i's ``counts``."""
    p = dist.get_world_size(group)
    if p == 1:
        return counts[None]
    rows = [torch.empty_like(counts) for _ in range(p)]
    dist.all_gather(rows, counts, group=group)
    return torch.stack(rows)


def _first_pairs(expert: Tensor, kept: Tensor) -> Tensor:
    """The pairs to send, sorted by expert (token order inside): of expert e's pairs, the
    first ``kept[e]``."""
    order = torch.sort(expert, stable=True).indices
    counts = torch.bincount(expert, minlength=len(kept))
    place = torch.arange(len(order)) - (counts.cumsum(0) - counts)[expert[order]]
    return order[place < kept[expert[order]]]


class ExpertParallelMoE(nn.Module):
    """``moe``'s experts split over the ranks of ``group``; see the module's docstring."""

    def __init__(
        self, moe: MoE, group: ProcessGroup | None = None, capacity_factor: float | None = None
    ) -> None:
        super().__init__()
        self.moe, self.group, self.capacity_factor = moe, group, capacity_factor
        self.p, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.num_experts = len(moe.experts)
        if self.num_experts % self.p:
            raise ValueError(
                f"num_experts={self.num_experts} is not divisible by the expert-parallel "
                f"size {self.p}"
            )
        self.per_rank = self.num_experts // self.p
        self.first = self.rank * self.per_rank  # this rank's experts: first .. first+per_rank-1

    def _kept(self, counts: Tensor) -> Tensor:
        """``[p, E]``: how many of rank i's pairs expert e keeps. Capacity C per expert, the
        first C pairs in global order (rank by rank), as Switch's capacity factor."""
        if self.capacity_factor is None:
            return counts
        tokens = int(counts.sum()) // self.moe.top_k
        capacity = math.ceil(self.capacity_factor * self.moe.top_k * tokens / self.num_experts)
        before = counts.cumsum(0) - counts  # pairs of the ranks before, per expert
        return (capacity - before).clamp(0).minimum(counts)

    def forward(self, x: Tensor) -> Tensor:
        """This rank's tokens ``[T_r, d]`` -> their outputs ``[T_r, d]``."""
        k, p, n = self.moe.top_k, self.p, self.per_rank
        experts, gates = self.moe.route(x)  # [T_r, k] each
        token = torch.arange(len(x)).repeat_interleave(k)  # every (token, expert) pair
        expert, gate = experts.reshape(-1), gates.reshape(-1)

        # 1. counts, then drop what exceeds an expert's capacity (never sent).
        counts = torch.bincount(expert, minlength=self.num_experts)
        kept = self._kept(_exchange_counts(counts, self.group))
        order = _first_pairs(expert, kept[self.rank])  # sorted by expert, token order inside

        # 2. dispatch: rows sorted by expert are sorted by owning rank too.
        send_splits = kept[self.rank].view(p, n).sum(1).tolist()
        recv_splits = kept[:, self.first : self.first + n].sum(1).tolist()
        arrived = self._exchange(x[token[order]], send_splits, recv_splits)

        # 3. experts, on the rows from every rank for each of this rank's experts.
        outputs = self._run_experts(arrived, kept[:, self.first : self.first + n])

        # 4. combine: the mirror all-to-all, then the gate-weighted sum at home.
        returned = self._exchange(outputs, recv_splits, send_splits)
        return torch.zeros_like(x).index_add(0, token[order], gate[order, None] * returned)

    def _run_experts(self, arrived: Tensor, sizes: Tensor) -> Tensor:
        """``arrived`` is rank-major: rank i's rows for local expert 0, 1, .., then rank i+1's
        (``sizes[i, e]`` rows each). Regroup them expert-major, run each expert on its rows,
        and put the outputs back in arrival order, which is the order the combine sends."""
        p, n = sizes.shape
        starts = (sizes.reshape(-1).cumsum(0) - sizes.reshape(-1)).view(p, n)
        blocks = [
            range(starts[i, e], starts[i, e] + sizes[i, e]) for e in range(n) for i in range(p)
        ]
        regroup = torch.tensor([row for block in blocks for row in block], dtype=torch.long)
        by_expert = arrived[regroup].split(sizes.sum(0).tolist())
        outputs = [self.moe.experts[self.first + e](rows) for e, rows in enumerate(by_expert)]
        return torch.cat(outputs)[torch.argsort(regroup)]

    def _exchange(self, rows: Tensor, send_splits: list[int], recv_splits: list[int]) -> Tensor:
        if self.p == 1:
            return rows
        return _AllToAll.apply(rows, send_splits, recv_splits, self.group)

    def finish_gradient_synchronization(self) -> None:
        """The gradient of the mean over ranks of their losses: the router's gradients are
        averaged (every rank's tokens used its copy); each local expert's already holds every
        rank's contributions (they came back through the combine's backward), so it is / p."""
        for param in self.moe.router.parameters():
            if param.grad is None:  # no token of this rank reached an expert
                param.grad = torch.zeros_like(param)
            if self.p > 1:
                dist.all_reduce(param.grad, group=self.group)
            param.grad /= self.p
        for expert in self.moe.experts[self.first : self.first + self.per_rank]:
            for param in expert.parameters():
                if param.grad is not None:
                    param.grad /= self.p
