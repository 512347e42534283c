"""Data parallelism: bucketed gradient all-reduce (DDP) and a sharded optimizer (ZeRO-1).

Reference solution of `assignments/data_parallel.py`.

- `DataParallel` follows PyTorch's DistributedDataParallel as described by Li et al. 2020,
  "PyTorch Distributed: Experiences on Accelerating Data Parallel Training" (VLDB): gradients
  are grouped into buckets and each bucket is all-reduced asynchronously as soon as all its
  gradients are ready, so communication overlaps the rest of the backward pass.
- `ShardedOptimizer` is stage 1 of ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
  Toward Training Trillion Parameter Models"): each rank keeps optimizer state for 1/p of the
  parameters, updates only those, and then sends the updated values to every other rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim.optimizer import ParamsT

_MB = 2**20


@dataclass
class _Bucket:
    """Parameters whose gradients are all-reduced together, as one flat tensor."""

    params: list[nn.Parameter]
    pending: int = 0  # gradients not yet ready in this iteration
    flat: Tensor | None = None  # the flattened gradients being all-reduced
    work: dist.Work | None = field(default=None, repr=False)


def _build_buckets(params: list[nn.Parameter], cap_bytes: float) -> list[_Bucket]:
    """Greedily packs `params`, in the given order, into buckets of at most `cap_bytes`.

    A parameter larger than the cap gets a bucket of its own; a cap of 0 gives one bucket per
    parameter. A bucket holds a single dtype, since it is flattened into one tensor.
    """
    buckets: list[_Bucket] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        last = buckets[-1].params if buckets else None
        if last is None or size + nbytes > cap_bytes or last[0].dtype != p.dtype:
            buckets.append(_Bucket(params=[]))
            size = 0
        buckets[-1].params.append(p)
        size += nbytes
    return buckets


class DataParallel(nn.Module):
    """Replicates `module` on every rank and averages its gradients with bucketed all-reduces.

    Per step each rank sends about 2(p-1)/p of the gradient bytes (one ring all-reduce per
    bucket). Usage, on every rank::

        model = DataParallel(net)
        loss_fn(model(local_batch), local_targets).backward()
        model.finish_gradient_synchronization()  # every .grad is now the mean over ranks
        optimizer.step()

    Buckets are filled in reverse registration order, which approximates the order in which
    backward produces gradients (Li et al. 2020, section 3.2.3). Buckets are launched strictly
    in order, even if a later one is ready first: collectives are matched by issue order, so all
    ranks must issue the same all-reduces in the same sequence.

    Call `finish_gradient_synchronization()` exactly once after every backward pass.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0) -> None:
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()

        # Every replica starts from rank 0's state, whatever each rank was seeded with.
        with torch.no_grad():
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                dist.broadcast(tensor, src=0)

        # parameters() yields a tied parameter once; its hook fires once per backward, after
        # the gradients of all its uses have been accumulated. Frozen parameters have no grad.
        params = [p for p in module.parameters() if p.requires_grad]
        self._buckets = _build_buckets(params[::-1], bucket_size_mb * _MB)
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._reset()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _reset(self) -> None:
        for bucket in self._buckets:
            bucket.pending, bucket.flat, bucket.work = len(bucket.params), None, None
        self._next_bucket = 0  # index of the first bucket not yet launched

    def _on_grad_ready(self, param: Tensor) -> None:
        """Runs inside backward, right after `param.grad` received its final value."""
        self._bucket_of[param].pending -= 1
        buckets = self._buckets
        while self._next_bucket < len(buckets) and buckets[self._next_bucket].pending == 0:
            self._launch(buckets[self._next_bucket])

    def _launch(self, bucket: _Bucket) -> None:
        for p in bucket.params:
            # A parameter this rank did not use contributes zero (other ranks may have used it).
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket.flat = torch.cat([p.grad.reshape(-1) for p in bucket.params])
        bucket.work = dist.all_reduce(bucket.flat, async_op=True)
        self._next_bucket += 1

    def finish_gradient_synchronization(self) -> None:
        """Waits for every bucket's all-reduce and writes the mean gradient into each `.grad`.

        Buckets still waiting for a gradient (a parameter unused in this iteration, on this rank
        or on all) are launched now, with zeros for the missing gradients. So after this call
        every trainable parameter has a `.grad`; DDP instead spends one more all-reduce of a
        bitmap to leave the gradients of globally unused parameters untouched.
        """
        for bucket in self._buckets[self._next_bucket :]:
            self._launch(bucket)
        with torch.no_grad():
            for bucket in self._buckets:
                assert bucket.work is not None and bucket.flat is not None
                bucket.work.wait()
                bucket.flat.div_(self.world_size)  # sum -> mean
                offset = 0
                for p in bucket.params:
                    p.grad.copy_(bucket.flat[offset : offset + p.numel()].view_as(p.grad))
                    offset += p.numel()
        self._reset()


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1: optimizer state is partitioned across ranks (Rajbhandari et al. 2020).

    Each parameter is owned by one rank, assigned greedily to the least-loaded rank (in
    elements) in the order parameters are added, which every rank computes identically. The
    wrapped `optimizer_cls` sees only this rank's parameters, so its state (e.g. AdamW's two
    moments, 8 bytes per fp32 parameter) takes 1/p of the memory. `step()` updates the own shard
    and then broadcasts every parameter from its owner: together the broadcasts move the bytes of
    one all-gather of the parameters, (p-1)/p of them received per rank.

    Gradients must already be identical on every rank (e.g. after `DataParallel`'s
    synchronization). `self.param_groups` holds all parameters, so the inherited `zero_grad()`
    clears every gradient, and a learning-rate scheduler that edits `self.param_groups` is
    honoured: the hyperparameters are copied to the local optimizer before each step.
    """

    def __init__(
        self, params: ParamsT, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any
    ) -> None:
        self._optimizer_cls = optimizer_cls
        self._optimizer_kwargs = kwargs
        self._rank = dist.get_rank()
        self._owner: dict[Tensor, int] = {}  # parameter -> owning rank, in insertion order
        self._load = [0] * dist.get_world_size()  # elements owned by each rank
        self._local: torch.optim.Optimizer | None = None
        # The base class calls self.add_param_group once per group.
        super().__init__(params, defaults=kwargs)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)  # normalizes the group and fills in defaults
        group = self.param_groups[-1]
        local_params = []
        for p in group["params"]:
            owner = min(range(len(self._load)), key=self._load.__getitem__)
            self._owner[p] = owner
            self._load[owner] += p.numel()
            if owner == self._rank:
                local_params.append(p)
        # The local group keeps the group's hyperparameters; it may be empty on some ranks.
        local_group = {**self._hyperparameters(group), "params": local_params}
        if self._local is None:
            self._local = self._optimizer_cls([local_group], **self._optimizer_kwargs)
        else:
            self._local.add_param_group(local_group)

    @staticmethod
    def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in group.items() if k not in ("params", "param_names")}

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        assert self._local is not None
        for group, local_group in zip(self.param_groups, self._local.param_groups, strict=True):
            local_group.update(self._hyperparameters(group))
        self._local.step()
        with torch.no_grad():
            works = [
                dist.broadcast(p, src=owner, async_op=True) for p, owner in self._owner.items()
            ]
            for work in works:
                work.wait()
        return loss
