"""An overlay on ``ep_decoy_combine`` (graded as ``ep_decoy_combine+ep_scrambled_combine``):
the forward's combine carries the experts' outputs, but every peer's values sorted, so they
no longer form rows; the home rank keeps using its own outputs, so nothing else changes. As
values the combine is right; as rows it is not."""

import torch

_Zeros = _DecoyCombine  # noqa: F821 (ep_decoy_combine's, which this file follows)


class _DecoyCombine(_Zeros):
    @staticmethod
    def forward(ctx, outputs, local, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        pieces = outputs.detach().split(send_splits)
        scrambled = torch.cat([p.reshape(-1).sort().values.view_as(p) for p in pieces])
        _all_to_all(scrambled, send_splits, recv_splits, group)  # noqa: F405
        return local
