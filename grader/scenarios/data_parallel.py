"""The rank-side half of the data_parallel tests: drives DataParallel and ShardedOptimizer.

Each scenario builds what the test sent (a model's initial state, batches, parameters and
gradients), runs the student's class on it and returns what it saw: parameters after each
step, gradients after each synchronization. It holds no expected value; the test compares
with a one-process float64 oracle on the trusted side.
The model class and the optimizer settings live here because both sides need them.
"""

from __future__ import annotations

import itertools
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grader.scenarios import gate, measured_gate

DIM = 8
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01}),
}
# The ShardedOptimizer's cases: optimizer, its kwargs, the second param group's own settings.
SHARDED: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any], dict[str, Any]]] = {
    "sgd_momentum": (
        torch.optim.SGD,
        {"lr": 0.1, "momentum": 0.9},
        {"lr": 0.05, "weight_decay": 0.1},
    ),
    "adamw": (
        torch.optim.AdamW,
        {"lr": 0.01, "weight_decay": 0.1},
        {"lr": 0.03, "betas": (0.8, 0.9)},
    ),
}
# The first param group's own settings, in the test that gives it some (else the defaults).
FIRST_SETTINGS: dict[str, dict[str, Any]] = {
    "sgd_momentum": {"lr": 0.02, "momentum": 0.5},
    "adamw": {"lr": 0.002, "betas": (0.85, 0.95), "weight_decay": 0.3},
}
FIRST_GROUP = 4  # parameters 0..3 are the first param group, the rest are added later
Batches = list[tuple[Tensor, Tensor]]


class TiedNet(nn.Module):
    """embed and head share one weight; ``frozen`` is not trained; ``scale`` is a buffer.

    Each feature hides a classic DDP mistake: the tied weight is counted twice by code that
    hooks every (module, parameter) pair, the frozen layer is given a gradient by code that
    ignores ``requires_grad``, and the buffer differs between ranks unless it is broadcast.
    ``use_hidden=False`` skips ``hidden``: its parameters get no gradient in that iteration,
    on every rank, so their hooks never fire (the bucket that waits for them must still go).
    """

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM, bias=False)
        self.frozen = nn.Linear(DIM, DIM).requires_grad_(False)
        self.hidden = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, DIM)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(DIM))

    def forward(self, x: Tensor, use_hidden: bool = True) -> Tensor:
        h = self.frozen(torch.tanh(self.embed(x) * self.scale))
        return self.head(torch.tanh(self.hidden(h) if use_hidden else h))


def tensors_of(module: nn.Module) -> dict[str, Tensor]:
    """Parameters (a tied one once) and buffers by name: a model's whole state."""
    return dict(itertools.chain(module.named_parameters(), module.named_buffers()))


def build(state: dict[str, Tensor]) -> TiedNet:
    """A float64 TiedNet holding ``state`` (made on the trusted side, from its secret seed)."""
    net = TiedNet().double()
    with torch.no_grad():
        for name, tensor in tensors_of(net).items():
            tensor.copy_(state[name])
    return net


def _snapshot(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {name: t.detach().clone() for name, t in tensors.items()}


def _grads(module: nn.Module) -> dict[str, Tensor | None]:
    return {
        name: None if q.grad is None else q.grad.detach().clone()
        for name, q in module.named_parameters()
    }


def train(
    student: ModuleType,
    state: dict[str, Tensor],
    optimizer: str,
    bucket_size_mb: float,
    batches: Batches,
    unused: int = 0,
) -> dict[str, Any]:
    """Wrap a TiedNet holding ``state`` and train it on this rank's slice of each batch.

    In iteration ``unused`` (1-based; 0: none) the model skips its ``hidden`` layer.

    Returns the wrapped model's state right after wrapping (``initial``), every parameter's
    gradient after each synchronization (``grads``) and the parameters after each step
    (``params``). If the wrapper keeps no ``.module``, ``module`` names what it holds instead
    and nothing is trained.
    """
    dp = student.DataParallel(build(state), bucket_size_mb=bucket_size_mb)
    module = getattr(dp, "module", None)
    if not isinstance(module, nn.Module):
        return {"module": type(module).__name__}
    seen: dict[str, Any] = {"module": "", "initial": _snapshot(tensors_of(module))}
    seen["grads"], seen["params"] = [], []
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = cls(module.parameters(), **kwargs)
    for step, (x, y) in enumerate(batches, start=1):
        F.mse_loss(dp(x, use_hidden=step != unused), y).backward()
        dp.finish_gradient_synchronization()
        seen["grads"].append(_grads(module))
        opt.step()
        seen["params"].append(_snapshot(dict(module.named_parameters())))
        opt.zero_grad()
    return seen


class Gated(torch.autograd.Function):
    """The identity forward; in backward, the gradient times a factor only the broker holds.

    Placed on the embedding's output, it is where backward reaches the first layer: the
    scenario asks the broker for the factor there (:func:`grader.scenarios.gate`), and the
    broker records whether this rank had already started an all-reduce of gradients computed
    before it. The factor is secret, so the gradients come out right only if this point is
    really passed, inside backward.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, label: str) -> Tensor:
        ctx.label = label
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * gate(ctx.label).to(grad.dtype), None


def overlap(
    student: ModuleType, state: dict[str, Tensor], bucket_size_mb: float, rows: list[int]
) -> list[dict[str, Tensor | None]]:
    """Backward and synchronization of one batch per entry of ``rows`` (its rows on this
    rank), through the test's gates: ``iteration i input`` hands over the batch (inputs, then
    targets, flat), and the gate at the embedding's output (:class:`Gated`) is where backward
    reaches the first layer. The broker's record of the all-reduces between these gates shows
    which iteration each belongs to and whether it started during backward. Returns every
    parameter's gradient after each synchronization (they are cleared between batches).
    """
    net, label = build(state), ["iteration 1"]
    net.embed.register_forward_hook(lambda module, args, out: Gated.apply(out, label[0]))
    dp = student.DataParallel(net, bucket_size_mb=bucket_size_mb)
    grads = []
    for i, n in enumerate(rows, start=1):
        x, y = gate(f"iteration {i} input").view(2, n, DIM).unbind()
        label[0] = f"iteration {i}"
        F.mse_loss(dp(x), y).backward()
        dp.finish_gradient_synchronization()
        grads.append(_grads(net))
        for q in net.parameters():
            q.grad = None
    return grads


def param_groups(
    initial: list[Tensor],
    second: dict[str, Any],
    first: dict[str, Any] | None = None,
    split: int = FIRST_GROUP,
) -> tuple[list[nn.Parameter], list[dict[str, Any]]]:
    """Parameters holding ``initial``, in two param groups: ``initial[:split]`` with ``first``'s
    settings, the rest with ``second``'s. Both sides build them alike: the rank for the
    student's optimizer, the test for the unsharded one."""
    params = [nn.Parameter(t.clone()) for t in initial]
    return params, [
        {"params": params[:split], **(first or {})},
        {"params": params[split:], **second},
    ]


def sharded(
    student: ModuleType,
    optimizer: str,
    initial: list[Tensor],
    grads: list[list[Tensor | None]],
    own_first: bool = False,
    split: int = FIRST_GROUP,
) -> dict[str, Any]:
    """Steps of the student's ShardedOptimizer over ``initial``, in two param groups.

    The first group (``initial[:split]``, with ``FIRST_SETTINGS`` if ``own_first``) goes to the
    constructor; the second is added with ``add_param_group`` and has its own hyperparameters.
    Before step s every parameter i gets ``grads[s][i]`` (None: no gradient). Returns the
    parameters after each step (``params``) and the parameters still holding a nonzero
    gradient after each ``zero_grad()`` (``kept``).
    """
    cls, kwargs, second = SHARDED[optimizer]
    first = FIRST_SETTINGS[optimizer] if own_first else None
    params, (group, later) = param_groups(initial, second, first, split)
    opt = student.ShardedOptimizer([group], cls, **kwargs)
    opt.add_param_group(later)
    seen: dict[str, Any] = {"params": [], "kept": []}
    for step_grads in grads:
        for q, g in zip(params, step_grads, strict=True):
            q.grad = None if g is None else g.clone()
        opt.step()
        seen["params"].append([q.detach().clone() for q in params])
        opt.zero_grad()
        kept = [i for i, q in enumerate(params) if q.grad is not None and bool(q.grad.any())]
        seen["kept"].append(kept)
    return seen


def hold_state(student: ModuleType, width: int, depth: int, steps: int) -> None:
    """``steps`` steps of the student's ShardedOptimizer(AdamW) over ``depth`` square
    parameters (the same gradients on every rank), the broker reading the rank's memory at
    each gate (:func:`grader.scenarios.measured_gate`): before the parameters exist, once
    made, once the optimizer holds them, in each step once the gradients are set, after the
    step and after ``zero_grad()``, and once everything is dropped."""
    measured_gate("start")
    gen = torch.Generator().manual_seed(depth)
    params = [nn.Parameter(torch.empty(width, width).normal_(generator=gen)) for _ in range(depth)]
    measured_gate("built")
    opt = student.ShardedOptimizer(params, torch.optim.AdamW, lr=1e-3)
    measured_gate("wrapped")
    for step in range(1, steps + 1):
        for q in params:
            q.grad = torch.empty_like(q).normal_(generator=gen)
        measured_gate(f"step {step} grads")
        opt.step()
        measured_gate(f"step {step} stepped")
        opt.zero_grad()
        measured_gate(f"step {step} rest")
    del opt, params
    measured_gate("end")
