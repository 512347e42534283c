"""DataParallel never broadcasts rank 0's parameters and buffers at construction.

Ranks seeded differently keep different models; everything else is the reference's.
"""

import torch.distributed as dist
from torch import nn

from reference import data_parallel as _reference
from reference.data_parallel import *  # noqa: F403


class DataParallel(_reference.DataParallel):
    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0) -> None:
        nn.Module.__init__(self)
        self.module = module
        self.world_size = dist.get_world_size()
        # the bug: no dist.broadcast of the parameters and buffers from rank 0
        params = [p for p in module.parameters() if p.requires_grad]
        self._buckets = _reference._build_buckets(params[::-1], bucket_size_mb * _reference._MB)
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._reset()
