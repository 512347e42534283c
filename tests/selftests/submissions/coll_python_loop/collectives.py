"""The reference's ring all-reduce, with each step's sum taken element by element in a
Python loop: the messages are the reference's, the local work is a hundred times its. The
broker's accounting sees that work as the rank's CPU time between its messages."""

import torch

from reference.collectives import *  # noqa: F403


def _ring_reduce_scatter(ranks, pieces):
    me, p = ranks.me, ranks.world_size
    incoming = pieces.buffer.new_empty(pieces.largest())
    for step in range(p - 1):
        outgoing, summed = pieces[me - step - 1], pieces[me - step - 2]
        received = incoming[: summed.numel()]
        _send_recv(ranks, send=outgoing, to=me + 1, recv=received, source=me - 1)  # noqa: F405
        sums = [a + b for a, b in zip(summed.tolist(), received.tolist(), strict=True)]
        summed.copy_(torch.tensor(sums, dtype=summed.dtype))
