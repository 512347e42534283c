"""Rank-side scenario of the context_parallel part: one forward and backward of attention.

The trusted side draws this rank's block of q, k, v and of the output's gradient and sends
them; the scenario calls the submission's ``ring_attention`` or ``ulysses_attention`` on
them, backpropagates, and returns what it saw. It holds no expected value: the graded test
compares what comes back with one-process attention run in float64 on the trusted side.
The marks around the forward and the backward only say where one ends in the broker's
record; every verdict on the messages rests on what the messages carried.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from torch import Tensor

from grader.scenarios import mark


def attention(
    student: ModuleType, function: str, q: Tensor, k: Tensor, v: Tensor, causal: bool, grad: Tensor
) -> dict[str, Any]:
    """``student.<function>(q, k, v, causal)``, then ``backward(grad)``: output and gradients."""
    leaves = [t.requires_grad_() for t in (q, k, v)]
    mark("forward")
    out = getattr(student, function)(*leaves, causal)
    mark("backward")
    seen: dict[str, Any] = {"output_type": type(out).__name__, "output": None}
    if isinstance(out, Tensor):
        seen["output"] = out.detach().clone()  # before backward: nothing may change it later
        out.backward(grad)
    mark("end")
    seen.update(dq=q.grad, dk=k.grad, dv=v.grad)
    return seen
