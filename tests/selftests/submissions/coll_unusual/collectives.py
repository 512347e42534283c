"""Correct, but not the classic algorithms: naive all-to-all exchanges and linear sends.

A careful TA gives every correctness point: the results are right. (The
communication tests of issue 4 are where such algorithms lose points.)
"""

import torch
import torch.distributed as dist

from reference.collectives import *  # noqa: F403


def all_reduce(tensor, group=None):
    """Every rank sends its whole tensor to every other rank, then sums locally."""
    rank, p = dist.get_rank(), dist.get_world_size()
    mine = tensor.detach().contiguous().clone()
    total = mine.clone()
    incoming = [torch.empty_like(mine) for _ in range(p)]
    requests = []
    for peer in range(p):
        if peer != rank:
            requests.append(dist.isend(mine, peer))
            requests.append(dist.irecv(incoming[peer], peer))
    for request in requests:
        request.wait()
    for peer in range(p):
        if peer != rank:
            total += incoming[peer]
    tensor.copy_(total)


def broadcast(tensor, src, group=None):
    """The root sends to every other rank in turn."""
    if dist.get_rank() == src:
        for peer in range(dist.get_world_size()):
            if peer != src:
                dist.send(tensor.contiguous(), peer)
    else:
        buffer = torch.empty_like(tensor).contiguous()
        dist.recv(buffer, src)
        tensor.copy_(buffer)
