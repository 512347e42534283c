"""Ulysses putting the pieces from the ranks together position by position (rank 0's first
position, rank 1's first, ...) instead of rank by rank, and taking them apart the same way:
every position comes home, but causal attention masks them in the wrong order.
"""

import torch
import torch.distributed as dist

from reference.context_parallel import *  # noqa: F403


def _sequence_to_heads(x, group):
    p = dist.get_world_size(group)
    if p == 1:
        return x
    pieces = _all_to_all(list(x.chunk(p, dim=1)), group)  # noqa: F405
    b, h, n, d = pieces[0].shape
    return torch.stack(pieces, dim=3).reshape(b, h, n * p, d)  # the bug: interleaved


def _heads_to_sequence(x, group):
    p = dist.get_world_size(group)
    if p == 1:
        return x
    b, h, s, d = x.shape
    pieces = list(x.reshape(b, h, s // p, p, d).unbind(3))
    return torch.cat(_all_to_all(pieces, group), dim=1)  # noqa: F405
