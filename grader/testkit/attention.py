"""One-process attention in float64: the oracle of the context_parallel tests, on the trusted side.

:func:`attention` runs softmax(q k^T / sqrt(D)) v over the whole sequence, with autograd
for dq, dk and dv, and gives each result's rounding magnitude: the sum of the absolute
values of the terms behind every element, which :func:`grader.testkit.check_close` scales
its tolerance with. ``allowed`` replaces the causal mask to model a wrong one (a mistake's
result, for the explanations). :class:`Observed` is what a rank's scenario returned, read
into one checked record.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grader.testkit.observed import (
    read_bool,
    read_every_rank,
    read_record,
    read_tensor_or_none,
    read_type_name,
)


@dataclass(frozen=True)
class Attention:
    """Results and rounding magnitudes, each ``[B, H, S, D]`` in float64."""

    output: Tensor
    dq: Tensor
    dk: Tensor
    dv: Tensor
    magnitudes: dict[str, Tensor]
    terms: int  # how many roundings one element may carry, for check_close
    max_score: float  # the largest |score|
    row_max: Tensor  # each query row's largest score, [B, H, S, 1]: exp(score) overflows there

    def result(self, name: str) -> Tensor:
        return {"output": self.output, "dq": self.dq, "dk": self.dk, "dv": self.dv}[name]


def causal_mask(s: int) -> Tensor:
    """True where query i may attend to key j: j <= i."""
    return torch.ones(s, s, dtype=torch.bool).tril()


def attention(
    q: Tensor, k: Tensor, v: Tensor, grad: Tensor, causal: bool, allowed: Tensor | None = None
) -> Attention:
    """Attention over the whole sequence and its gradients for the upstream ``grad``."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    grad = grad.double()
    s, d = q.size(-2), q.size(-1)
    scale = d**-0.5
    if allowed is None and causal:
        allowed = causal_mask(s)
    scores = (q @ k.transpose(-2, -1)) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = probs @ v
    out.backward(grad)
    probs, g = probs.detach(), grad.abs()
    d_probs = g @ v.detach().abs().transpose(-2, -1) + (g * out.detach().abs()).sum(-1, True)
    d_scores = probs * d_probs
    finite = scores.detach()[scores.detach().isfinite()]
    max_score = float(finite.abs().max()) if finite.numel() else 0.0
    magnitudes = {
        "output": probs @ v.detach().abs(),
        "dq": scale * d_scores @ k.detach().abs(),
        "dk": scale * d_scores.transpose(-2, -1) @ q.detach().abs(),
        "dv": probs.transpose(-2, -1) @ g,
    }
    # A score rounds to about D ulps of its size, and exp turns that absolute error into a
    # relative one of the weight: hence the term in the largest score.
    terms = s + d + d * math.ceil(max_score)
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    return Attention(out.detach(), q.grad, k.grad, v.grad, magnitudes, terms, max_score, row_max)


@dataclass(frozen=True)
class Observed:
    """What a rank's :func:`grader.scenarios.context_parallel.attention` saw, read and checked
    here: the output (None: the function returned an ``output_type``), whether it had a
    grad_fn, and the gradients (None: no ``.grad``)."""

    output_type: str
    output: Tensor | None
    differentiable: bool
    dq: Tensor | None
    dk: Tensor | None
    dv: Tensor | None

    def result(self, name: str) -> Tensor | None:
        return {"output": self.output, "dq": self.dq, "dk": self.dk, "dv": self.dv}[name]

    @classmethod
    def read(cls, tree: Any) -> Observed:
        """The record of ``tree``, a rank's return; ProtocolError unless it has exactly this
        structure."""
        tensors = {name: read_tensor_or_none for name in ("output", "dq", "dk", "dv")}
        fields = {"output_type": read_type_name, "differentiable": read_bool, **tensors}
        return cls(**read_record(tree, fields))


def observations(returned: Sequence[Any], case: str) -> list[Observed]:
    """Every rank's :class:`Observed` (:func:`~grader.testkit.observed.read_every_rank`)."""
    return read_every_rank(returned, Observed.read, "context_parallel.attention", case)
