"""Wrong results of the kinds students produce; the other functions are correct."""

import torch
import torch.distributed as dist

from reference.collectives import *  # noqa: F403


def all_reduce(tensor, group=None):
    """A ring all-reduce whose reduce-scatter is off by one: it stops one step short."""
    rank, p = dist.get_rank(), dist.get_world_size()
    buf = tensor.detach().reshape(-1).clone()
    chunks = list(buf.tensor_split(p))
    for step in range(p - 2):  # should be p - 1
        send_chunk = chunks[(rank - step) % p]
        recv_chunk = torch.empty_like(chunks[(rank - step - 1) % p])
        request = dist.isend(send_chunk.clone(), (rank + 1) % p)
        dist.recv(recv_chunk, (rank - 1) % p)
        request.wait()
        chunks[(rank - step - 1) % p] += recv_chunk
    for step in range(p - 1):
        send_chunk = chunks[(rank + 1 - step) % p]
        recv_chunk = chunks[(rank - step) % p]
        request = dist.isend(send_chunk.clone(), (rank + 1) % p)
        incoming = torch.empty_like(recv_chunk)
        dist.recv(incoming, (rank - 1) % p)
        request.wait()
        recv_chunk.copy_(incoming)
    tensor.copy_(torch.cat(chunks).view_as(tensor))


def all_gather(tensor_list, tensor, group=None):
    """Recursive doubling: right only when the world size is a power of two."""
    rank, p = dist.get_rank(), dist.get_world_size()
    have = {rank: tensor.detach().clone().contiguous()}
    distance = 1
    while distance < p:
        partner = rank ^ distance
        if partner < p:
            mine = torch.stack([have[r] for r in sorted(have)])
            theirs = torch.empty_like(mine)
            request = dist.isend(mine, partner)
            dist.recv(theirs, partner)
            request.wait()
            base = partner & ~(distance - 1)
            for i in range(theirs.shape[0]):
                have[base + i] = theirs[i]
        distance *= 2
    for r in range(p):
        if r in have:
            tensor_list[r].copy_(have[r])


def broadcast(tensor, src, group=None):
    """Receives into a new tensor and never copies it back into the caller's."""
    if dist.get_rank() == src:
        for peer in range(dist.get_world_size()):
            if peer != src:
                dist.send(tensor.contiguous(), peer)
    else:
        tensor = torch.empty_like(tensor).contiguous()
        dist.recv(tensor, src)


def reduce(tensor, dst, group=None):
    """Forgets the last rank's contribution."""
    rank, p = dist.get_rank(), dist.get_world_size()
    if rank == dst:
        total = tensor.detach().clone()
        for peer in range(p):
            incoming = torch.empty_like(tensor).contiguous()
            if peer != dst:
                dist.recv(incoming, peer)
                if peer != p - 1 or p == 1:
                    total += incoming
        tensor.copy_(total)
    else:
        dist.send(tensor.contiguous(), dst)
