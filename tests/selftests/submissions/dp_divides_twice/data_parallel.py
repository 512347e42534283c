"""DataParallel divides the summed gradients by the world size twice.

Every gradient comes out 1/p of the one-process gradient (right at p = 1); the schedule is
right, and so is the ShardedOptimizer.
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
                bucket.flat.div_(self.world_size)
                bucket.flat.div_(self.world_size)  # the bug: the mean divided again
                offset = 0
                for p in bucket.params:
                    p.grad.copy_(bucket.flat[offset : offset + p.numel()].view_as(p.grad))
                    offset += p.numel()
        self._reset()
