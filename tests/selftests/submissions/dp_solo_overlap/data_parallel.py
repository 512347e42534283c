"""Overlap shown by a message that never left the rank (graded as
``dp_decoy_overlap+dp_solo_overlap``: that attack's averaging, an all-gather of every bucket
in the world after backward, with these launches): each bucket's all-reduce is launched from
the gradient hooks carrying the bucket's gradients, as the reference's is, but in a group of
one (the rank alone), which completes at once. Training is right, and the broker saw the
right gradients in an all-reduce during backward: only its group tells that no other rank
received them.
"""

import torch
import torch.distributed as dist

from reference.data_parallel import *  # noqa: F403


def alone():
    """This rank's group of one (every rank makes every rank's, as new_group requires)."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return groups[dist.get_rank()]


class DataParallel(DataParallel):  # noqa: F405 (dp_decoy_overlap's, with its all-gather)
    def __init__(self, module, bucket_size_mb=25.0):
        super().__init__(module, bucket_size_mb)
        self.alone = alone()

    def _launch(self, bucket):
        for p in bucket.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket.flat = torch.cat([p.grad.reshape(-1) for p in bucket.params])
        bucket.work = dist.all_reduce(bucket.flat.clone(), group=self.alone, async_op=True)
        self._next_bucket += 1
