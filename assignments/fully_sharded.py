"""Assignment: fully sharded data parallelism (ZeRO stage 3, PyTorch FSDP).

You may use the collectives of `torch.distributed`: `all_gather_into_tensor`,
`reduce_scatter_tensor`, `all_reduce` (and the list forms `all_gather`, `reduce_scatter`), with
`async_op=True` where you want communication to overlap computation. Every rank calls them
collectively on the default process group, in the same order.

Reading:
- Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models" (SC), section 5.3: parameter partitioning (stage 3, P_os+g+p).
- Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel"
  (VLDB), sections 3 and 4: flat padded shards, forward prefetch, mixed precision.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


class FullyShardedDataParallel(nn.Module):
    """Keeps only 1/p of every sharded parameter on each rank; gathers a layer just in time.

    Usage, on every rank (each rank builds the very same `module`: nothing is broadcast)::

        model = FullyShardedDataParallel(net, compute_dtype=torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters())  # steps on the float32 shards
        loss_fn(model(local_batch), local_targets).backward()
        model.finish_gradient_synchronization()
        optimizer.step()

    Sharding (at construction)
        - Every module `m` in `module.modules()` with `isinstance(m, shard_types)` is a *sharded
          layer*; all its own parameters (`m.named_parameters(recurse=False)`: a Linear's weight
          AND bias) are sharded. Every other parameter (a norm's weight, say) is *replicated*:
          kept whole on every rank, as in DDP.
        - A sharded parameter of n elements is flattened and zero-padded at the end to p*s
          elements, s = ceil(n/p); rank r keeps elements [r*s, (r+1)*s). Between steps the
          parameter (the same `nn.Parameter` object, so `module.parameters()` and any optimizer
          see it) has `.data` equal to this float32 shard, of shape `(s,)`.
        - `self.module` is `module`. Sharded layers run in their registration order in forward.
        - Keep `module`'s submodules and parameters as they are (the same objects, at the same
          names): hook them, do not replace or wrap them. The tests hook them too, right
          after construction: register your hooks in `__init__`, so that your gathers run
          before the tests' hooks.

    forward(*args, **kwargs)
        Returns what `module(*args, **kwargs)` would with the full weights, differentiably.
        - Just before a sharded layer runs, its full parameters are all-gathered from the shards
          (the first n elements of the gathered p*s, reshaped: never the padding). The gather
          of the next layer(s) may be issued while a layer computes (prefetch), but at most two
          layers ahead of the one computing: never everything up front.
        - Right after the layer ran, its full parameters are freed: nothing (not the module,
          not your wrapper, not autograd's saved tensors) keeps them until backward.
        - In backward, a layer whose backward needs its full weight (a Linear: the input's
          gradient is grad_out @ W) gathers it again, in reverse layer order, and frees it after.
          An Embedding's backward needs only the indices: it need not be gathered again.
        - As soon as a sharded parameter's full gradient is computed, it is reduce-scattered
          (sum, float32, padded to p*s with zeros): rank r gets the sum of elements
          [r*s, (r+1)*s) over ranks. One reduce-scatter per sharded parameter per step.

    compute_dtype (None, or e.g. `torch.float16`, `torch.bfloat16`)
        - The shard is cast to `compute_dtype` BEFORE it is all-gathered (16-bit gathers move
          half the bytes); the sharded layers' floating-point inputs are cast to it too, so that
          they compute in it. Integer inputs (token ids) stay as they are.
        - Gradients: the full gradient (in the compute dtype) is cast to float32 before the
          reduce-scatter; `.grad` and the master shards are float32.

    finish_gradient_synchronization()
        Call once after every `backward()`. Waits for the outstanding reduce-scatters and
        all-reduces the replicated parameters' gradients. Afterwards:
        - a sharded parameter's `.grad` is this rank's shard of the MEAN gradient over ranks:
          shape `(s,)`, float32, the padding's elements zero;
        - a replicated parameter's `.grad` is the mean over ranks, identical on every rank.
        A parameter with no gradient on this rank (unused) contributes zeros.

    gather_full_params() -> dict[str, Tensor]
        Collective. The full float32 parameters by name, exactly as
        `module.named_parameters()` names them when unwrapped ("fc1.weight"), at their
        original shapes, padding removed; replicated ones as they are.

    Communication per step (per rank, p ranks, N sharded elements, c bytes per compute
    element): all-gather in forward ~ (p-1)/p N c, again in backward for the Linear weights,
    reduce-scatter ~ (p-1)/p N * 4 bytes, plus the replicated gradients' all-reduce. At p = 1
    the collectives move nothing.

    Hints
        - `dist.all_gather_into_tensor(out, shard, async_op=True)` fills `out` of p*s elements
          with every rank's shard in rank order; `dist.reduce_scatter_tensor(out, full_padded)`
          is its mirror. Keep the handle and `.wait()` before you use the result.
        - Forward hooks: `layer.register_forward_pre_hook(hook)` runs before `layer.forward`
          (it may return new args: the cast inputs); `layer.register_forward_hook(hook)` after.
          During the call, make the layer see the full weight, e.g. by putting a tensor in
          `layer._parameters[name]` and the shard back after.
        - Autograd must route the full weight's gradient to your reduce-scatter: a small
          `torch.autograd.Function` whose forward returns the gathered weight and whose backward
          receives its gradient is the classic way.
        - `torch.autograd.graph.saved_tensors_hooks(pack, unpack)` around the forward lets you
          replace a full weight that autograd saves for backward by a note, and gather it again
          in `unpack`, which backward calls exactly when it needs it.

    Pitfalls
        - Gather and reduce-scatter each sharded parameter on its own (a Linear's weight and
          bias are two gathers), not a layer's parameters concatenated into one flat buffer
          as PyTorch FSDP's FlatParameter does: the tests tell parameters by their sizes.
        - Autograd saves a view of the weight (`weight.t()` for a Linear), not the tensor:
          recognise it by its storage while its layer is gathered.
        - A prefetched gather whose layer does not run must still be waited for.
        - The mean, not the sum: divide by p.
        - The padding must never reach the gathered weight nor the gradient: slice [:n].
        - Parameter counts that p does not divide (the graded models have them everywhere).
        - Cast before communicating, not after: a float32 gather of a bfloat16 model moves twice
          the bytes.
        - `.grad` of a sharded parameter has the shard's shape and float32, not the full shape,
          not the compute dtype.
        - All ranks must issue the same collectives in the same order (gathers, prefetches and
          reduce-scatters alike), or they deadlock.
    """

    def __init__(
        self,
        module: nn.Module,
        compute_dtype: torch.dtype | None = None,
        shard_types: tuple[type[nn.Module], ...] = (nn.Linear, nn.Embedding),
    ) -> None:
        super().__init__()
        raise NotImplementedError("FullyShardedDataParallel.__init__: shard the parameters")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("FullyShardedDataParallel.forward: gather, run, free")

    def finish_gradient_synchronization(self) -> None:
        raise NotImplementedError("FullyShardedDataParallel.finish_gradient_synchronization")

    def gather_full_params(self) -> dict[str, Tensor]:
        raise NotImplementedError("FullyShardedDataParallel.gather_full_params")
