"""Rank-side scenario of the context_parallel part: one forward and backward of attention.

The trusted side draws this rank's block of q, k, v and sends them; the scenario calls the
submission's ``ring_attention`` or ``ulysses_attention`` on them, then passes the test's
gate "backward", which hands over this rank's block of the output's gradient, backpropagates
it, and returns what it saw. It holds no expected value: the graded test compares what comes
back with one-process attention run in float64 on the trusted side. No message that needs
the gradient can come before the gate, so where the rank passed it is where its forward
ended: a causal fact in the broker's record, which no mark can forge.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from torch import Tensor

from grader.scenarios import gate


def attention(
    student: ModuleType, function: str, q: Tensor, k: Tensor, v: Tensor, causal: bool
) -> dict[str, Any]:
    """``student.<function>(q, k, v, causal)``, then ``backward`` of the gradient the gate
    "backward" hands over: the output and the gradients."""
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = getattr(student, function)(*leaves, causal)
    grad = gate("backward").to(q.dtype).view(q.shape)
    seen: dict[str, Any] = {
        "output_type": type(out).__name__,
        "output": None,
        "differentiable": False,  # no grad_fn: the test says which call
    }
    if isinstance(out, Tensor):
        seen["output"] = out.detach().clone()  # before backward: nothing may change it later
        seen["differentiable"] = out.requires_grad
        if out.requires_grad:
            out.backward(grad)
    seen.update(dq=q.grad, dk=k.grad, dv=v.grad)
    return seen
