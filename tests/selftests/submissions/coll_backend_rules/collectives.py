"""What gloo and NCCL refuse, written as public tutorials write it; the others are correct.

- broadcast sends and receives the caller's tensor as it is, also when it is a
  non-contiguous view: gloo raises "input tensor has to be contiguous".
- all_reduce sends with isend and never waits for the requests: on NCCL the buffer may be
  reused before it is sent.
"""

import torch
import torch.distributed as dist

from reference.collectives import *  # noqa: F403


def broadcast(tensor, src, group=None):
    if dist.get_rank() == src:
        for peer in range(dist.get_world_size()):
            if peer != src:
                dist.send(tensor, peer)
    else:
        dist.recv(tensor, src)


def all_reduce(tensor, group=None):
    me, p = dist.get_rank(), dist.get_world_size()
    mine = tensor.contiguous().clone()
    for peer in range(p):
        if peer != me:
            dist.isend(mine, peer)  # never waited
    total = mine.clone()
    for peer in range(p):
        if peer != me:
            theirs = torch.empty_like(mine)
            dist.irecv(theirs, peer).wait()
            total += theirs
    tensor.copy_(total)
