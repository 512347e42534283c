"""DataParallel sums the gradients over ranks and never divides by the world size.

Every gradient comes out p times the one-process gradient; the schedule (overlap, number and
size of the all-reduces) is right, and so is the ShardedOptimizer.
"""

import torch

from reference import data_parallel as _reference
from reference.data_parallel import *  # noqa: F403


class DataParallel(_reference.DataParallel):
    def finish_gradient_synchronization(self) -> None:
        for bucket in self._buckets[self._next_bucket :]:
            self._launch(bucket)
        with torch.no_grad():
            for bucket in self._buckets:
                bucket.work.wait()
                # the bug: no bucket.flat.div_(self.world_size)
                offset = 0
                for p in bucket.params:
                    p.grad.copy_(bucket.flat[offset : offset + p.numel()].view_as(p.grad))
                    offset += p.numel()
        self._reset()
