"""The all-gather concatenates the ranks' tensors along dim 0, not the last dimension.

gather_from_parallel_region's output (and the column-parallel output it gathers) has the
ranks' slices stacked as rows: (2p, 3, n) where (2, 3, n p) is expected.
"""

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from reference.tensor_parallel import *  # noqa: F403


def _gather_last_dim(x: Tensor, group: ProcessGroup | None) -> Tensor:
    p = dist.get_world_size(group)
    if p == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(p)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=0)  # the bug: dim=-1
