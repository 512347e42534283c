"""Assignment: fully sharded data parallelism (ZeRO stage 3, PyTorch FSDP).

You may use the collectives of `torch.distributed`: `all_gather_into_tensor`,
`reduce_scatter_tensor`, `all_reduce` (and the list forms `all_gather`, `reduce_scatter`), with
`async_op=True` where communication should overlap computation. Every rank calls them
collectively on the default process group, in the same order.

Hints
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

    Sharding: every parameter of a `shard_types` module (a Linear's weight and bias) is flattened
    and zero-padded at the end to p*s elements (s = ceil(n/p)); rank r keeps elements
    [r*s, (r+1)*s): between steps the same `nn.Parameter`'s `.data` is that float32 shard, shape
    `(s,)`. Others (norms) are replicated. `self.module` is `module`, hooked, never replaced. Only
    rank r's shard of each sharded parameter of the `module` it is given holds the model's values;
    the rest must not be read (a wrapper that broadcasts the module from one rank breaks).

    Forward returns what `module` would with full weights, differentiably. A layer's full
    parameters are all-gathered just before it runs (at most two layers ahead) and freed right
    after: no reference stays in the module, the wrapper or autograd's saved tensors. Backward
    gathers a Linear's weight again, in reverse layer order, and reduce-scatters each full
    gradient (a float32 sum) before the backward of the layer that runs next finishes.
    `compute_dtype` (None, `torch.float16`, `torch.bfloat16`): shards and the sharded layers'
    floating inputs are cast to it before they travel; gradients and master shards stay float32.

    `finish_gradient_synchronization()`, after each backward: a sharded parameter's `.grad` is
    its shard of the mean gradient (`(s,)`, float32, padding zero), a replicated one's the mean.
    `gather_full_params()`: every full float32 parameter, by its name in the unwrapped module.

    Communication per step: one all-gather per sharded parameter in the compute dtype in
    forward, again for the Linear weights in backward, (p-1)/p of its bytes each; one float32
    reduce-scatter per sharded parameter; the replicated gradients' all-reduce.

    Graded (`grader list fully_sharded`): 3 steps of SGD and AdamW in each compute dtype against
    one process on the whole batch, within a tolerance; every gradient shard; each gather's and
    reduce-scatter's content, order and bytes. Float32 matches up to rounding only: each rank
    sums its own rows' gradients and the ranks' sums are added afterwards, where one process
    sums all rows at once (`benchmarks/fsdp_split_batch.py`). Bit for bit, it equals data
    parallelism on the same split that adds the ranks' sums in the same order.

    Hints
        Usage, on every rank (each its own `module`, right in its own shards: no broadcast)::

            model = FullyShardedDataParallel(net, compute_dtype=torch.bfloat16)
            optimizer = torch.optim.AdamW(model.parameters())  # steps on the float32 shards
            loss_fn(model(local_batch), local_targets).backward()
            model.finish_gradient_synchronization()
            optimizer.step()

        - Sharded layers run in their registration order in forward. Hook them, do not
          replace or wrap them: the tests hook them too, right after construction, so
          register your hooks in `__init__` for your gathers to run before the tests' hooks.
        - Only the first n elements of the gathered p*s are the weight (reshaped): never the
          padding. The gather of the next layer(s) may be issued while a layer computes
          (prefetch), at most two layers ahead: never everything up front.
        - Reduce-scatter a parameter's full gradient as soon as backward has computed it,
          padded to p*s with zeros, so it overlaps the rest of the backward: rank r gets the
          sum of elements [r*s, (r+1)*s) over ranks. `finish_gradient_synchronization` then
          waits for them, divides by p, and all-reduces the replicated gradients; a parameter
          this rank did not use contributes zeros.
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
          in `unpack`, which backward calls exactly when it needs it. Autograd saves a view of
          the weight (`weight.t()` for a Linear), not the tensor: recognise it by its storage
          while its layer is gathered.
        - Gather and reduce-scatter each sharded parameter on its own (a Linear's weight and
          bias are two gathers), not a layer's parameters concatenated into one flat buffer
          as PyTorch FSDP's FlatParameter does: the tests tell parameters by their sizes.
        - A prefetched gather whose layer does not run must still be waited for.
        - The mean, not the sum: divide by p. Integer inputs (token ids) are not cast.
        - Cast before communicating, not after: a float32 gather of a bfloat16 model moves
          twice the bytes. Cast the full gradient to float32 before the reduce-scatter.
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
        raise NotImplementedError(
            "fully_sharded.FullyShardedDataParallel.__init__: not implemented yet"
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "fully_sharded.FullyShardedDataParallel.forward: not implemented yet"
        )

    def finish_gradient_synchronization(self) -> None:
        raise NotImplementedError(
            "fully_sharded.FullyShardedDataParallel.finish_gradient_synchronization: "
            "not implemented yet"
        )

    def gather_full_params(self) -> dict[str, Tensor]:
        raise NotImplementedError(
            "fully_sharded.FullyShardedDataParallel.gather_full_params: not implemented yet"
        )
