"""Every all-reduce averages (ReduceOp.AVG, or a sum divided by p) where a sum is needed.

copy_to's backward gives 1/p of the input's gradient, reduce_from's forward 1/p of the
sum of the partial products: right at p = 1 only.
"""

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from reference.tensor_parallel import *  # noqa: F403


def _all_reduce(x: Tensor, group: ProcessGroup | None) -> Tensor:
    p = dist.get_world_size(group)
    if p == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out / p  # the bug: the mean, not the sum
