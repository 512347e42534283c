"""Rank-side scenario of the fully_sharded part: wrap a small model, train it, report back.

The trusted side makes the model's initial state and every rank's batch; the scenario builds
the same model on every rank, wraps it in the submission's ``FullyShardedDataParallel``, trains
it a few steps and returns what it saw: the gradients after each synchronization, the shapes
of the parameters between steps, the gathered parameters at the end. Marks in the broker's
record delimit each phase and each sharded layer's forward and backward, so that the test can
place the broker's all-gathers and reduce-scatters. The model (:class:`Net`) is defined here
once: the one-process oracle on the trusted side trains the very same module.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grader.scenarios import mark

VOCAB, DIM, HIDDEN, OUT = 13, 10, 23, 9  # no size is divisible by every p in 2..4
DTYPES = {"float32": None, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Norm(nn.Module):
    """RMSNorm in float32 whatever its input's dtype, returned in that dtype (replicated)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight).to(x.dtype)


class Net(nn.Module):
    """Embedding, norm, MLP, norm, head: the sharded modules run in registration order."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm1 = Norm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, OUT)
        self.norm2 = Norm(OUT)
        self.head = nn.Linear(OUT, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.norm1(self.embed(tokens))
        h = self.norm2(self.fc2(F.gelu(self.fc1(h))))
        return self.head(h)


SHARDED = ("embed", "fc1", "fc2", "head")  # the shard_types modules, in forward order


def build(state: dict[str, Tensor]) -> Net:
    """The model with exactly ``state``'s values: both sides build it so."""
    with torch.device("meta"):  # no random draws: the values come from the trusted side
        net = Net()
    net.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)
    return net


def loss_of(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    """SGD with momentum, or AdamW with ``eps=1e-3``: with the default 1e-8, a gradient near
    zero whose sign an honest change of summation order flips moves a weight by a whole
    step, and the comparison with one process would rest on luck."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.2, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.02, eps=1e-3, weight_decay=0.1)


def _shapes(net: nn.Module) -> dict[str, list[int]]:
    return {name: list(p.data.shape) for name, p in net.named_parameters()}


def _grads(net: nn.Module) -> dict[str, Tensor | None]:
    return {
        name: None if p.grad is None else p.grad.detach().clone()
        for name, p in net.named_parameters()
    }


def _mark_layers(net: Net) -> None:
    """A mark as each sharded layer starts its forward and its backward (after the wrapper's
    own hooks, which were registered first: its gathers come before the mark)."""
    for i, name in enumerate(SHARDED):
        layer = getattr(net, name)
        layer.register_forward_pre_hook(lambda *_, i=i: mark(f"forward {i}"))
        layer.register_full_backward_pre_hook(lambda *_, i=i: mark(f"backward {i}"))


def train(
    student: ModuleType,
    state: dict[str, Tensor],
    tokens: Tensor,
    targets: Tensor,
    optimizer_name: str,
    dtype: str,
    steps: int,
) -> dict[str, Any]:
    """``steps`` steps of training on this rank's batch; what the rank saw at each."""
    net = build(state)
    model = student.FullyShardedDataParallel(net, compute_dtype=DTYPES[dtype])
    _mark_layers(net)
    opt = optimizer(optimizer_name, model.parameters())
    seen: dict[str, Any] = {"grads": [], "after_forward": [], "at_rest": [_shapes(net)]}
    for _ in range(steps):
        mark("forward")
        logits = model(tokens)
        seen["after_forward"].append(_shapes(net))
        mark("backward")
        loss_of(logits, targets).backward()
        mark("finish")
        model.finish_gradient_synchronization()
        mark("step")
        seen["grads"].append(_grads(net))
        opt.step()
        opt.zero_grad()
        seen["at_rest"].append(_shapes(net))
    mark("gather")
    full = model.gather_full_params()
    seen["full"] = (
        {k: v.detach().clone() for k, v in full.items()} if isinstance(full, dict) else None
    )
    return seen
