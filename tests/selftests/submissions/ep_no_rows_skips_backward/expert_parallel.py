"""A rank that received no rows for its experts skips the dispatch's backward all-to-all.

The reference's layer, but the all-to-all's backward returns zeros at once where nothing
arrived in the forward ("no rows came, so no gradient goes back"): the rank's own rows'
gradients never come home, and the other ranks wait in an all-to-all it never posts.
"""

import torch

from reference import expert_parallel as _reference
from reference.expert_parallel import *  # noqa: F403


class _SkippingAllToAll(_reference._AllToAll):
    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.shape = x.shape
        return _reference._AllToAll.forward(ctx, x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        _, recv_splits = ctx.splits
        if not any(recv_splits):  # the bug: nothing arrived, so nothing to send back
            return torch.zeros(ctx.shape, dtype=grad.dtype), None, None, None
        return _reference._AllToAll.backward(ctx, grad)


class ExpertParallelMoE(_reference.ExpertParallelMoE):
    def _exchange(self, rows, send_splits, recv_splits):
        if self.p == 1:
            return rows
        return _SkippingAllToAll.apply(rows, send_splits, recv_splits, self.group)
