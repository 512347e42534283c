"""Shards are `torch.chunk(p)` pieces, with no padding: fine when p divides every parameter's
size, but a parameter of 23 elements on 2 ranks gives shards of 12 and 11, and the ranks'
all-gathers disagree.
"""

from reference.fully_sharded import *  # noqa: F403


def _shard(tensor, rank, world_size):
    return tensor.detach().reshape(-1).chunk(world_size)[rank].clone()  # the bug: no padding
