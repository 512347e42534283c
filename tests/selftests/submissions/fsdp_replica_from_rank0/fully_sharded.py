"""The reference, but the wrapper first makes every rank's module rank 0's: a broadcast of
every parameter from rank 0, as data parallelism does, before sharding. Each rank is handed
the model's values only in its own shard of each sharded parameter: rank 0's module holds
them in rank 0's shard alone, so every other rank keeps a shard of values that are not the
model's and trains on them.
"""

import torch.distributed as dist

from reference import fully_sharded as _reference
from reference.fully_sharded import *  # noqa: F403


class FullyShardedDataParallel(_reference.FullyShardedDataParallel):
    def __init__(self, module, *args, **kwargs):
        for param in module.parameters():
            dist.broadcast(param.data, src=0)  # the bug: rank 0's module everywhere
        super().__init__(module, *args, **kwargs)
