"""Fully sharded data parallelism: ZeRO stage 3, as PyTorch's FSDP does it.

Reference solution of `assignments/fully_sharded.py`.

- ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models", section 5.3): stage 3 partitions the parameters themselves. Each rank
  keeps 1/p of every parameter; a layer's full weight exists only while the layer computes,
  all-gathered just before, freed just after, and gathered again for the backward pass.
  Gradients are reduce-scattered, so each rank ends with the gradient of its own shard and
  steps the optimizer on it alone. Per step a rank moves about 3(p-1)/p of the parameter bytes
  (all-gather, all-gather, reduce-scatter): 1.5x plain data parallelism's all-reduce.
- PyTorch FSDP (Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data
  Parallel", VLDB): flat, zero-padded shards (rank r holds elements [r*s, (r+1)*s),
  s = ceil(n/p)); the gather of the next layer issued before the current one computes
  (forward prefetch, section 3.3.2); mixed precision by casting the shard before it is
  gathered, so the gather moves half the bytes, while gradients are reduced and the optimizer
  steps in float32 (section 4.4).

The three pieces, at a glance:

    pre-forward hook     gather(layer) and prefetch gather(next layer); swap the full weights in
    saved-tensor hooks   a full weight saved for backward is kept as a note to gather it again
    _Unshard.backward    reduce-scatter the full weight's gradient into this rank's shard
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

PREFETCH = 1  # layers gathered ahead of the one computing (the contract allows up to 2)


@dataclass
class _Sharded:
    """One sharded parameter: this rank's flat shard and the collectives that move it."""

    name: str  # the parameter's name in its module ("weight", "bias")
    param: nn.Parameter  # .data is the float32 shard [s] between steps
    shape: torch.Size  # the full parameter's shape
    numel: int
    compute_dtype: torch.dtype
    full: Tensor | None = None  # the gathered weight, while some computation needs it
    gather_work: dist.Work | None = field(default=None, repr=False)
    flat: Tensor | None = None  # the gather's padded [p*s] buffer
    grad: Tensor | None = None  # the reduce-scatter's float32 output, this rank's shard
    grad_work: dist.Work | None = field(default=None, repr=False)

    def start_gather(self) -> None:
        """Issue the all-gather of the shards, cast BEFORE they travel (16 bit: half the bytes)."""
        if self.full is not None or self.gather_work is not None:
            return
        shard = self.param.detach().to(self.compute_dtype)
        self.flat = torch.empty(shard.numel() * dist.get_world_size(), dtype=self.compute_dtype)
        self.gather_work = dist.all_gather_into_tensor(self.flat, shard, async_op=True)

    def wait_gather(self) -> Tensor:
        """The full weight: the first `numel` gathered elements (the rest is padding)."""
        if self.full is None:
            self.start_gather()
            assert self.gather_work is not None and self.flat is not None
            self.gather_work.wait()
            self.full = self.flat[: self.numel].view(self.shape)
            self.gather_work = self.flat = None
        return self.full

    def free(self) -> None:
        self.full = None  # the last reference: the full weight's memory goes back

    def start_reduce_scatter(self, full_grad: Tensor) -> None:
        """Sum the full gradient over ranks, in float32, into this rank's shard."""
        p = dist.get_world_size()
        padded = torch.zeros(self.param.numel() * p, dtype=torch.float32)
        padded[: self.numel] = full_grad.reshape(-1)  # padding's gradient stays zero
        self.grad = torch.empty(self.param.numel(), dtype=torch.float32)
        self.grad_work = dist.reduce_scatter_tensor(self.grad, padded, async_op=True)


class _Unshard(torch.autograd.Function):
    """Forward: the gathered full weight. Backward: its gradient, reduce-scattered to the shard.

    The shard (a leaf) gets no gradient from autograd: the reduce-scatter is asynchronous and
    `finish_gradient_synchronization` writes its result into `.grad`.
    """

    @staticmethod
    def forward(ctx: Any, shard: Tensor, sharded: _Sharded) -> Tensor:
        ctx.sharded = sharded
        return sharded.wait_gather()

    @staticmethod
    def backward(ctx: Any, grad_full: Tensor) -> tuple[None, None]:
        sharded: _Sharded = ctx.sharded
        sharded.free()  # backward is done with the weight that was gathered again for it
        sharded.start_reduce_scatter(grad_full)
        return None, None


def _shard(tensor: Tensor, rank: int, world_size: int) -> Tensor:
    """Elements [r*s, (r+1)*s) of the flattened tensor, zero-padded to p*s, s = ceil(n/p)."""
    s = math.ceil(tensor.numel() / world_size)
    padded = F.pad(tensor.detach().reshape(-1), (0, s * world_size - tensor.numel()))
    return padded[rank * s : (rank + 1) * s].clone()


class FullyShardedDataParallel(nn.Module):
    """Shards every parameter of the `shard_types` modules of `module` across the ranks.

    Usage, on every rank (each its own `module`, right in its own shards: no broadcast)::

        model = FullyShardedDataParallel(net, compute_dtype=torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters())  # the float32 shards
        loss_fn(model(local_batch), local_targets).backward()
        model.finish_gradient_synchronization()  # every .grad: this rank's shard of the mean
        optimizer.step()

    Other parameters (norms) are replicated and their gradients all-reduced, as in DDP.
    The sharded modules must run in their registration order (FSDP records the order of the
    first iteration instead; a fixed order keeps the prefetch readable).
    """

    def __init__(
        self,
        module: nn.Module,
        compute_dtype: torch.dtype | None = None,
        shard_types: tuple[type[nn.Module], ...] = (nn.Linear, nn.Embedding),
    ) -> None:
        super().__init__()
        self.module = module
        self.world_size, rank = dist.get_world_size(), dist.get_rank()
        self._layers: list[tuple[nn.Module, list[_Sharded]]] = []
        sharded_params: set[nn.Parameter] = set()
        for layer in module.modules():
            if not isinstance(layer, shard_types):
                continue
            shards = []
            for name, param in layer.named_parameters(recurse=False):
                dtype = compute_dtype or param.dtype
                shards.append(_Sharded(name, param, param.shape, param.numel(), dtype))
                param.data = _shard(param, rank, self.world_size)
                sharded_params.add(param)
            self._layers.append((layer, shards))
            index = len(self._layers) - 1
            layer.register_forward_pre_hook(self._pre_forward(index, compute_dtype))
            layer.register_forward_hook(self._post_forward(index))
        self._replicated = [p for p in module.parameters() if p not in sharded_params]
        self._storage_of: dict[int, _Sharded] = {}  # gathered storage -> its parameter

    # -- forward: gather just in time, free right after ---------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # A full weight that autograd saves for backward is not kept: only a note to gather it
        # again (FSDP frees the storage and re-gathers in a pre-backward hook: the same idea).
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return self.module(*args, **kwargs)

    def _pre_forward(self, index: int, compute_dtype: torch.dtype | None) -> Callable:
        def hook(layer: nn.Module, args: tuple) -> tuple:
            for _, shards in self._layers[index : index + 1 + PREFETCH]:
                for sharded in shards:  # prefetch: the next layer's gather flies meanwhile
                    sharded.start_gather()
            for sharded in self._layers[index][1]:
                full = _Unshard.apply(sharded.param, sharded)
                self._storage_of[full.untyped_storage().data_ptr()] = sharded
                layer._parameters[sharded.name] = full  # swapped in for this call only
            if compute_dtype is None:
                return args
            return tuple(_cast(a, compute_dtype) for a in args)

        return hook

    def _post_forward(self, index: int) -> Callable:
        def hook(layer: nn.Module, args: tuple, output: Any) -> None:
            for sharded in self._layers[index][1]:
                layer._parameters[sharded.name] = sharded.param  # the shard again
                self._storage_of.pop(sharded.full.untyped_storage().data_ptr(), None)
                sharded.free()

        return hook

    def _pack(self, tensor: Tensor) -> Any:
        sharded = self._storage_of.get(tensor.untyped_storage().data_ptr())
        if sharded is None:
            return tensor  # an activation: saved as usual
        return sharded, tensor.size(), tensor.stride(), tensor.storage_offset()

    @staticmethod
    def _unpack(packed: Any) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        sharded, size, stride, offset = packed
        full = sharded.wait_gather()  # backward's gather, in reverse order by construction
        return full.as_strided(size, stride, offset)

    # -- after backward ------------------------------------------------------------------------

    def finish_gradient_synchronization(self) -> None:
        """Waits for the reduce-scatters; all-reduces the replicated parameters' gradients.

        Afterwards a sharded parameter's `.grad` is its shard [s] of the mean gradient (float32)
        and a replicated parameter's `.grad` is the mean, the same on every rank.
        """
        replicated = []
        for p in self._replicated:
            if p.grad is None:  # unused on this rank: it contributes zero
                p.grad = torch.zeros_like(p)
            replicated.append(dist.all_reduce(p.grad, async_op=True))
        for _, shards in self._layers:
            for sharded in shards:
                if sharded.grad is None:  # a layer this rank did not use
                    sharded.start_reduce_scatter(torch.zeros(sharded.shape))
                assert sharded.grad_work is not None
                sharded.grad_work.wait()
                sharded.param.grad = sharded.grad.div_(self.world_size)  # sum -> mean
                sharded.grad = sharded.grad_work = None
        for work, p in zip(replicated, self._replicated, strict=True):
            work.wait()
            p.grad.div_(self.world_size)

    def gather_full_params(self) -> dict[str, Tensor]:
        """Every parameter at full shape in float32, named as in the unwrapped module."""
        full_of: dict[nn.Parameter, Tensor] = {}
        for _, shards in self._layers:
            for sharded in shards:
                flat = torch.empty(sharded.param.numel() * self.world_size)
                dist.all_gather_into_tensor(flat, sharded.param.detach())
                full_of[sharded.param] = flat[: sharded.numel].view(sharded.shape)
        return {
            name: full_of.get(p, p.detach()).clone() for name, p in self.module.named_parameters()
        }


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """A floating tensor in the compute dtype; anything else (token ids) as it is."""
    if isinstance(value, Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value
