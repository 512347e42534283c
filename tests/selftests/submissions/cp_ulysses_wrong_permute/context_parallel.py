"""Ulysses putting the received pieces together by a reshape without the permute.

Stacked, the pieces are [p, B, H/p, S/p, D] (peer first); a reshape to [B, H/p, S, D] without
moving the peer dimension next to the positions first mixes batch rows, heads and positions.
What is sent is right; what each rank attends over is not. At one rank nothing moves.
"""

import torch
import torch.distributed as dist

from reference.context_parallel import *  # noqa: F403


def _sequence_to_heads(x, group):
    p = dist.get_world_size(group)
    if p == 1:
        return x
    received = torch.stack(_all_to_all(list(x.chunk(p, dim=1)), group))  # noqa: F405
    batch, heads, n, d = x.shape
    return received.reshape(batch, heads // p, p * n, d)  # the bug: no permute(1, 2, 0, 3, 4)
