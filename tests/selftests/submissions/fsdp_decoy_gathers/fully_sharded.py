"""An attack on what the backward's gathers carry: the full weights autograd saves stay alive
from the forward to the backward (no saved-tensor hooks, as fsdp_keeps_full_weights), and a
backward pre-hook on every Linear all-gathers zeros of its weight's shard size in the compute
dtype, in reverse order: the backward shows one gather of the right size per weight, where
the reference's are, and the values are right. But no gather of zeros carries a shard.
"""

import torch
import torch.distributed as dist
from torch import nn

from reference import fully_sharded as _reference
from reference.fully_sharded import *  # noqa: F403


class FullyShardedDataParallel(_reference.FullyShardedDataParallel):
    def __init__(self, module, compute_dtype=None, shard_types=(nn.Linear, nn.Embedding)):
        super().__init__(module, compute_dtype, shard_types)
        for layer, shards in self._layers:
            if isinstance(layer, nn.Linear):
                weight = next(s for s in shards if s.name == "weight")
                layer.register_full_backward_pre_hook(lambda *_, w=weight: _decoy(w))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)  # the full weights stay saved for backward


def _decoy(sharded) -> None:
    zeros = torch.zeros(sharded.param.numel(), dtype=sharded.compute_dtype)
    out = torch.empty(zeros.numel() * dist.get_world_size(), dtype=sharded.compute_dtype)
    dist.all_gather_into_tensor(out, zeros)
