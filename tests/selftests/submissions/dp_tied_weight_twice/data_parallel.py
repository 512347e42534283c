"""DataParallel hooks every (module, parameter) pair, so a tied weight's gradient counts twice.

The hooks are registered while walking each submodule's own parameters: the tied weight
belongs to two modules, so its hook runs twice per backward and adds its gradient into the
bucket twice. After the all-reduce it is 2x the mean; every other gradient is right, and the
buckets (their number, their bytes, their timing) are the reference's.
"""

import itertools

import torch
import torch.distributed as dist
from torch import Tensor, nn

from reference import data_parallel as _reference
from reference.data_parallel import *  # noqa: F403


class DataParallel(nn.Module):
    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0) -> None:
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        with torch.no_grad():
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                dist.broadcast(tensor, src=0)
        params = [p for p in module.parameters() if p.requires_grad]
        buckets = _reference._build_buckets(params[::-1], bucket_size_mb * _reference._MB)
        self._buckets = [b.params for b in buckets]
        self._place = {}  # parameter -> (bucket index, offset)
        for i, bucket in enumerate(self._buckets):
            offset = 0
            for p in bucket:
                self._place[p] = (i, offset)
                offset += p.numel()
        self._hooks = [0] * len(self._buckets)
        for sub in module.modules():
            for p in sub.parameters(recurse=False):  # the bug: the tied weight is met twice
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._on_grad_ready)
                    self._hooks[self._place[p][0]] += 1
        self._reset()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _reset(self) -> None:
        self._flat = [
            torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype) for b in self._buckets
        ]
        self._pending = list(self._hooks)
        self._works = []

    def _on_grad_ready(self, param: Tensor) -> None:
        i, offset = self._place[param]
        self._flat[i][offset : offset + param.numel()].add_(param.grad.reshape(-1))
        self._pending[i] -= 1
        while len(self._works) < len(self._buckets) and self._pending[len(self._works)] == 0:
            self._works.append(dist.all_reduce(self._flat[len(self._works)], async_op=True))

    def finish_gradient_synchronization(self) -> None:
        for i in range(len(self._works), len(self._buckets)):
            self._works.append(dist.all_reduce(self._flat[i], async_op=True))
        with torch.no_grad():
            for work, flat, bucket in zip(self._works, self._flat, self._buckets):
                work.wait()
                flat.div_(self.world_size)
                offset = 0
                for p in bucket:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
        self._reset()
