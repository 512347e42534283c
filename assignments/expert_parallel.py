"""Assignment: expert parallelism, a mixture-of-experts layer whose experts live on different ranks.

You may use the collectives of `torch.distributed`, above all `all_to_all_single` with split
sizes (`output_split_sizes`, `input_split_sizes`: rows to receive from, and send to, each
rank; any may be 0), and `all_gather` or `all_to_all` for the counts; or build the exchange
from `send`/`recv`/`isend`/`irecv` yourself. `group` is a process group (`None`: the default
group); p = `dist.get_world_size(group)`, r = `dist.get_rank(group)`. Every rank calls
collectively; p = 1 must work and send nothing. `MoE` below is the one-process layer, given:
do not change it (the grader builds its own copy of exactly this layer and hands it to your
`ExpertParallelMoE`).

Graded (`grader list expert_parallel`; points in tests/graded/grading.yaml), at p = 1..4:
your layer's output, the tokens' gradient and every gradient of the router and of this rank's
experts against `MoE` run on all ranks' tokens in one process, with E = p and 2p experts,
top-1 and top-2, a different number of tokens on every rank (one rank with no token for
some expert, one expert that no token chooses); capacity drops; identity experts with top-1
returning the tokens exactly. From the grader's record of what each rank sent
(`communication`, p >= 2): the counts exchanged before any token row, every rank sending
exactly the rows its tokens route to other ranks' experts and receiving back exactly as
many, no token ever all-gathered, and at p = 1 no communication at all.

Hints
    - Lepikhin et al. 2020, "GShard: Scaling Giant Models with Conditional Computation and
      Automatic Sharding", section 2 (experts spread over devices, tokens sent by all-to-all).
    - Fedus et al. 2021, "Switch Transformers: Scaling to Trillion Parameter Models with Simple
      and Efficient Sparsity", section 2.2 (expert capacity, the capacity factor, dropped
      tokens).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup


def expert_mlp(d: int, d_ff: int) -> nn.Sequential:
    """One expert: `Linear(d, d_ff)`, GELU, `Linear(d_ff, d)`."""
    return nn.Sequential(nn.Linear(d, d_ff), nn.GELU(), nn.Linear(d_ff, d))


class MoE(nn.Module):
    """A one-process mixture-of-experts layer (Shazeer et al. 2017; Switch, Fedus et al. 2021).

    `forward(x)` on tokens `[T, d]`: softmax over the router's logits, the `top_k` experts of
    every token (ties to the lower index), their probabilities renormalised to sum to 1 (the
    gates), and the gate-weighted sum of those experts' outputs. With `capacity`, expert e
    keeps only its first `capacity` (token, expert) pairs in token order; a dropped pair
    contributes nothing.
    """

    def __init__(self, d: int, d_ff: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
        self.router = nn.Linear(d, num_experts)
        self.experts = nn.ModuleList(expert_mlp(d, d_ff) for _ in range(num_experts))
        self.top_k = top_k

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Every token's `top_k` experts `[T, k]` (best first) and their gates `[T, k]`."""
        probs = self.router(x).softmax(dim=-1)
        # A stable descending sort keeps the lower index first among equal probabilities.
        order = torch.sort(probs, dim=-1, descending=True, stable=True).indices
        experts = order[:, : self.top_k]
        gates = probs.gather(1, experts)
        return experts, gates / gates.sum(dim=-1, keepdim=True)

    def forward(self, x: Tensor, capacity: int | None = None) -> Tensor:
        experts, gates = self.route(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tokens, slot = (experts == e).nonzero(as_tuple=True)  # in token order
            if capacity is not None:
                tokens, slot = tokens[:capacity], slot[:capacity]
            if len(tokens):
                out = out.index_add(0, tokens, gates[tokens, slot, None] * expert(x[tokens]))
        return out


class ExpertParallelMoE(nn.Module):
    """`moe`'s E experts split over the p ranks of `group`: rank r runs experts
    `[r*E/p, (r+1)*E/p)`; every rank keeps the router and routes its own tokens.

    - `__init__(moe, group=None, capacity_factor=None)`: `moe`, identical on every rank, is
      kept as `self.moe` and used in place (`self.moe.router`, `self.moe.experts[e]`).
      `ValueError` if p does not divide E, naming `num_experts`.
    - `forward(x)`: this rank's tokens `[T_r, d]` (T_r may differ between ranks) -> the rows
      `MoE` would give them, differentiable with respect to x, the router and the experts.
    - `capacity_factor`: each expert keeps at most `ceil(capacity_factor * top_k * T / E)`
      pairs, T all ranks' tokens: the first in global order (rank by rank, token order).
    - The loss is the mean over ranks of each rank's loss: `finish_gradient_synchronization()`
      averages the router's gradient over ranks and divides each local expert's by p.

    Communication per forward (p >= 2): the counts (E integers per rank, once or twice), then
    one dispatch and one combine all-to-all of exactly the kept pairs' rows; per backward the
    same two in reverse; then the router's gradients. Never all-gather tokens; at p = 1 nothing.
    Graded as in the module docstring.

    Hints
        1. Route with `self.moe.route(x)`: each token's k experts and gates; that makes
           T_r * k (token, expert) pairs. Count the pairs per expert.
        2. Exchange the counts first (an integer all-gather or all-to-all): a rank cannot
           know how many rows it will receive otherwise. Receive sizes come from the
           exchanged counts, never from a guess.
        3. Dispatch: send each pair's token row to the rank owning its expert with one
           `all_to_all_single` whose split sizes are those counts (sorted by expert, the rows
           are also sorted by destination rank). Rows arrive rank-major: rank 0's rows for
           your first expert, for your second, ..., then rank 1's.
        4. Regroup the arrived rows by local expert, run each expert on its rows, and put the
           outputs back in arrival order (undo the regrouping before the combine, or outputs
           go home to the wrong tokens).
        5. Combine: send the outputs home with the same all-to-all, splits swapped; there,
           multiply each by its gate and add it to its token's output row.

        Backward mirrors it (the gradient of an all-to-all is the all-to-all with the splits
        swapped): write the all-to-all as a `torch.autograd.Function` (or use
        `torch.distributed.nn.functional.all_to_all_single`). Keep the gates on their rank,
        attached to the graph: they carry the router's gradient (detached, it is lost).

        Capacity: the counts of every rank decide which pairs are kept, not the local ones:
        exchange counts before dropping (a second exchange of the kept counts is allowed). A
        dropped pair is never sent and contributes nothing.

        Gradients: `x.grad` is already dL_r/dx. Each local expert's gradient already collects
        every rank's contributions through the combine's backward: divide it by p. The router's
        is all-reduced and divided by p; a router that got no gradient on a rank takes part
        with zeros. Other ranks' experts keep `.grad` None.
    """

    def __init__(
        self, moe: MoE, group: ProcessGroup | None = None, capacity_factor: float | None = None
    ) -> None:
        raise NotImplementedError("expert_parallel.ExpertParallelMoE.__init__: not implemented yet")

    def forward(self, x: Tensor) -> Tensor:
        raise NotImplementedError("expert_parallel.ExpertParallelMoE.forward: not implemented yet")

    def finish_gradient_synchronization(self) -> None:
        raise NotImplementedError(
            "expert_parallel.ExpertParallelMoE.finish_gradient_synchronization: not implemented yet"
        )
