"""DataParallel's finish waits only for the buckets launched during backward.

When a parameter is unused on every rank, its hook never fires: its bucket, and every later
one (buckets launch in order), is never all-reduced, so those gradients stay each rank's own.
When every parameter is used, all is the reference's.
"""

import torch

from reference import data_parallel as _reference
from reference.data_parallel import *  # noqa: F403


class DataParallel(_reference.DataParallel):
    def finish_gradient_synchronization(self) -> None:
        with torch.no_grad():
            for bucket in self._buckets[: self._next_bucket]:  # the bug: the rest are skipped
                bucket.work.wait()
                bucket.flat.div_(self.world_size)
                offset = 0
                for p in bucket.params:
                    p.grad.copy_(bucket.flat[offset : offset + p.numel()].view_as(p.grad))
                    offset += p.numel()
        self._reset()
