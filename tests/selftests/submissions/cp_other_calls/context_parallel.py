"""An honest context_parallel made with other calls than the reference's: it earns every point.

The ring sends K and V as two messages with plain `isend`/`irecv` (no `batch_isend_irecv`);
Ulysses moves each tensor with one asynchronous `all_to_all_single` on a peer-first tensor,
each piece laid out transposed (a layout of the student's choosing: the broker's check
compares what a piece holds, not how it is laid out).
"""

import torch
import torch.distributed as dist

from reference.context_parallel import *  # noqa: F403


def _pass_on(block, group):
    p, r = dist.get_world_size(group), dist.get_rank(group)
    received = torch.empty_like(block)  # filled in place: its halves are received into
    works = []
    for half, into in zip(block.unbind(0), received.unbind(0), strict=True):  # K, V or dK, dV
        works.append(dist.isend(half.contiguous(), group=group, group_dst=(r + 1) % p))
        works.append(dist.irecv(into, group=group, group_src=(r - 1) % p))
    return received, works


def _all_to_all(pieces, group):
    sent = torch.stack([piece.transpose(-2, -1) for piece in pieces]).contiguous()
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group, async_op=True).wait()
    return [piece.transpose(-2, -1) for piece in received.unbind(0)]
