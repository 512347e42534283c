"""An honest variant: the dispatch and combine built from isend/irecv, not all_to_all_single.

The contract allows the student's own all-to-all; every test must pass, the broker's
record judged per peer.
"""

import torch
import torch.distributed as dist
from torch import Tensor

from reference.expert_parallel import *  # noqa: F403


def _all_to_all(x: Tensor, send_splits: list[int], recv_splits: list[int], group=None) -> Tensor:
    rank, x = dist.get_rank(group), x.contiguous()
    sent, received = x.split(send_splits), []
    ops = []
    for peer, (rows, count) in enumerate(zip(sent, recv_splits, strict=True)):
        if peer == rank:
            received.append(rows.clone())
            continue
        buffer = x.new_empty((count, *x.shape[1:]))
        received.append(buffer)
        if len(rows):
            ops.append(
                dist.P2POp(dist.isend, rows, dist.get_global_rank(group, peer) if group else peer)
            )
        if count:
            ops.append(
                dist.P2POp(dist.irecv, buffer, dist.get_global_rank(group, peer) if group else peer)
            )
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return torch.cat(received)
