"""Faults on rank 1 and on rank 3 (in reduce and all_reduce, in the correctness tests only).

Across two nodes of two ranks each, one of these two ranks always lives on the
node that does not grade: its death and its stack must reach the head anyway.
"""

import os
import time

import torch.distributed as dist

from reference.collectives import *  # noqa: F403
from reference.collectives import all_reduce as reference_all_reduce
from reference.collectives import reduce as reference_reduce
from reference.collectives import reduce_scatter as reference_reduce_scatter


def reduce(tensor, dst, group=None):
    """Rank 1 says a last word and exits."""
    if tensor.numel() < 1000 and dist.get_rank() == 1:
        print("rank 1 leaves now", flush=True)
        os._exit(3)
    reference_reduce(tensor, dst, group)


def all_reduce(tensor, group=None):
    """Rank 3 spins (a busy loop, not a wait the broker sees)."""
    if tensor.numel() < 1000 and dist.get_rank() == 3:
        while True:
            time.sleep(0.05)
    reference_all_reduce(tensor, group)


def reduce_scatter(output, input_list, group=None):
    """Ranks 1 and 3 forge what only a rank's trusted relay may say: that they ended well."""
    if dist.get_rank() in (1, 3):
        from grader import wire
        from grader.rank import link

        forged = wire.Frame({"type": "exited", "status": 0, "last_words": "all fine"})
        wire.send_frame(link.current().sock, forged)
    reference_reduce_scatter(output, input_list, group)
