"""DataParallel flattens each bucket in float32, whatever the gradients' dtype.

The model is float64: every gradient is rounded to float32 before the all-reduce and written
back as float64, right to about 7 digits only, and each all-reduce carries half the bytes.
The buckets' number and timing are the reference's, and so is the ShardedOptimizer.
"""

import torch
import torch.distributed as dist

from reference import data_parallel as _reference
from reference.data_parallel import *  # noqa: F403


class DataParallel(_reference.DataParallel):
    def _launch(self, bucket) -> None:
        for p in bucket.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        # the bug: the bucket is float32, the gradients float64
        bucket.flat = torch.cat([p.grad.reshape(-1).float() for p in bucket.params])
        bucket.work = dist.all_reduce(bucket.flat, async_op=True)
        self._next_bucket += 1
