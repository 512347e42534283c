"""Rank-side scenario of the expert_parallel part: one forward and backward of the student's MoE.

The trusted side draws one mixture-of-experts layer (:class:`MoE`, the layer that
``assignments/expert_parallel.py`` writes out for the students; this is the grader's own
copy, which the trusted side also runs as its one-process oracle) and sends its weights to
every rank, with the rank's own tokens and the upstream gradient of their outputs. The
scenario builds the layer, wraps it in the submission's ``ExpertParallelMoE``, runs one
forward, one backward and ``finish_gradient_synchronization()``, and sends back the output,
the tokens' gradient and the gradients of the layer's parameters (None where there is
none: no backward ran where the output is not a tensor). It holds no expected value.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn


def expert_mlp(d: int, d_ff: int) -> nn.Sequential:
    """One expert: ``Linear(d, d_ff)``, GELU, ``Linear(d_ff, d)``."""
    return nn.Sequential(nn.Linear(d, d_ff), nn.GELU(), nn.Linear(d_ff, d))


class MoE(nn.Module):
    """A one-process mixture-of-experts layer (Shazeer et al. 2017; Switch, Fedus et al. 2021).

    ``forward(x)`` on tokens ``[T, d]``: softmax over the router's logits, the ``top_k``
    experts of every token (ties to the lower index), their probabilities renormalised to
    sum to 1 (the gates), and the gate-weighted sum of those experts' outputs. With
    ``capacity``, expert e keeps only its first ``capacity`` (token, expert) pairs in token
    order; a dropped pair contributes nothing.
    """

    def __init__(self, d: int, d_ff: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
        self.router = nn.Linear(d, num_experts)
        self.experts = nn.ModuleList(expert_mlp(d, d_ff) for _ in range(num_experts))
        self.top_k = top_k

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Every token's ``top_k`` experts ``[T, k]`` (best first) and their gates ``[T, k]``."""
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


def build_moe(state: dict[str, Tensor], num_experts: int, top_k: int) -> MoE:
    """The :class:`MoE` holding ``state`` (its ``state_dict``); both sides build it."""
    d_ff, d = state["experts.0.0.weight"].shape
    with torch.device("meta"):  # no random draws: the values come from the trusted side
        moe = MoE(d, d_ff, num_experts, top_k)
    moe.load_state_dict({k: v.detach().clone() for k, v in state.items()}, assign=True)
    return moe


def identity_experts(moe: MoE) -> None:
    """Replace every expert by ``nn.Identity()``: dispatch and combine must then return the
    tokens exactly (with top-1 every gate is p / p = 1)."""
    moe.experts = nn.ModuleList(nn.Identity() for _ in moe.experts)


def forward_backward(
    student: ModuleType,
    state: dict[str, Tensor],
    num_experts: int,
    top_k: int,
    capacity_factor: float | None,
    x: Tensor,
    grad: Tensor,
    identity: bool,
) -> dict[str, Any]:
    """``ExpertParallelMoE(moe, capacity_factor=...)`` on this rank's tokens, then backward of
    ``(output * grad).sum()`` and ``finish_gradient_synchronization()``."""
    moe = build_moe(state, num_experts, top_k)
    if identity:
        identity_experts(moe)
    layer = student.ExpertParallelMoE(moe, capacity_factor=capacity_factor)
    y = layer(x.requires_grad_())
    seen: dict[str, Any] = {"output_type": type(y).__name__, "output": None}
    if isinstance(y, Tensor):
        seen["output"] = y.detach().clone()  # before backward: nothing may change it later
        if y.requires_grad:
            y.backward(grad)
        layer.finish_gradient_synchronization()
    seen["input_grad"] = x.grad
    seen["grads"] = {name: param.grad for name, param in moe.named_parameters()}
    return seen
