"""Ring attention whose ring turns the wrong way: every rank sends to rank r-1 and receives
from rank r+1, in forward and backward alike, while it still takes the block it holds at
step s to be rank (r-s)'s. At p = 2 both ways are one; from p = 3 on, causal attention
computes some blocks by the rule of another (non-causal attention sums every block anyway).
"""

import torch
import torch.distributed as dist

from reference.context_parallel import *  # noqa: F403


def _pass_on(block, group):
    p, r = dist.get_world_size(group), dist.get_rank(group)
    received = torch.empty_like(block)
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, block, group=group, group_peer=(r - 1) % p),  # the bug
            dist.P2POp(dist.irecv, received, group=group, group_peer=(r + 1) % p),
        ]
    )
    return received, works
