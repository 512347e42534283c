"""Rank-side scenario of the fully_sharded part: wrap a small model, train it, report back.

The trusted side makes the model's initial state and every rank's batch, and hands each rank
the model's values only in its own shard of each sharded parameter (values drawn for it
elsewhere); the scenario builds that module, wraps it in the submission's
``FullyShardedDataParallel``, trains it a few steps and returns what it saw: the gradients
after each synchronization, the shapes of the parameters between steps, the gathered
parameters at the end.

What the steps need comes only through the test's gates (:func:`gate`), so that the broker's
record shows where the rank's code really was: each step's tokens where the embedding starts
its forward, a factor on the input of every other sharded layer where it starts, the targets
where the loss is computed, a factor on the gradient of each such input where the layer's
backward has computed it, and the learning rate where the optimizer steps. The test places
the broker's all-gathers and reduce-scatters between them; nothing the rank says is read.
The model (:class:`Net`) is defined here once: the one-process oracle on the trusted side
trains the very same module, with the same factors (:func:`scale_inputs`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grader.scenarios import gate, measured_gate

VOCAB, DIM, HIDDEN, OUT = 13, 10, 23, 9  # no size is divisible by every p in 2..4
SEQ = 5  # tokens per row
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
    step, and the comparison with one process would rest on luck. The learning rate is the
    test's, set before each step."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.0, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.0, eps=1e-3, weight_decay=0.1)


class _Scaled(torch.autograd.Function):
    """The identity forward; in backward, the gradient times ``factor()``: on a rank a gate's
    secret, so the backward really passes the gate there (the gradients of every layer below
    depend on it), in the oracle the secret itself."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: Callable[[], float]) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor(), None


def scale_inputs(net: Net, factor: Callable[[int], float], back: Callable[[int], float]) -> None:
    """Multiply the input of every sharded layer after the embedding by ``factor(i)`` as its
    forward starts (after the wrapper's own hooks, which were registered first: its gathers,
    and its cast to the compute dtype, come before), and the gradient of that input by
    ``back(i)`` as the layer's backward has computed it."""
    for i, name in enumerate(SHARDED[1:], start=1):

        def hook(_: nn.Module, args: tuple, i: int = i) -> tuple:
            return (_Scaled.apply(args[0] * factor(i), lambda: back(i)),)

        getattr(net, name).register_forward_pre_hook(hook)


def _shapes(net: nn.Module) -> dict[str, list[int]]:
    return {name: list(p.data.shape) for name, p in net.named_parameters()}


def _grads(net: nn.Module) -> dict[str, Tensor | None]:
    return {
        name: None if p.grad is None else p.grad.detach().clone()
        for name, p in net.named_parameters()
    }


class _Gates:
    """The step's gates, each passed once, the first time the step's code needs it."""

    def __init__(self) -> None:
        self.step, self.got = 0, dict[str, Tensor]()

    def __call__(self, what: str) -> Tensor:
        label = f"step {self.step} {what}"
        if label not in self.got:
            self.got[label] = gate(label)
        return self.got[label]


def train(
    student: ModuleType,
    state: dict[str, Tensor],
    rows: int,
    optimizer_name: str,
    dtype: str,
    steps: int,
) -> dict[str, Any]:
    """``steps`` steps of training on this rank's ``rows`` rows; what the rank saw at each.

    The wrapper is given a stand-in of the tokens' shape (zeros): the embedding takes the
    step's real tokens at the gate "step s tokens" as its forward starts."""
    net = build(state)
    model = student.FullyShardedDataParallel(net, compute_dtype=DTYPES[dtype])
    gates = _Gates()
    net.embed.register_forward_pre_hook(lambda *_: (gates("tokens").long(),))
    scale_inputs(
        net, lambda i: float(gates(SHARDED[i])), lambda i: float(gates(f"back {SHARDED[i]}"))
    )
    opt = optimizer(optimizer_name, model.parameters())
    stand_in = torch.zeros(rows, SEQ, dtype=torch.long)
    seen: dict[str, Any] = {"grads": [], "after_forward": [], "at_rest": [_shapes(net)]}
    for step in range(1, steps + 1):
        gates.step = step
        logits = model(stand_in)
        seen["after_forward"].append(_shapes(net))
        loss_of(logits, gates("targets").long()).backward()
        model.finish_gradient_synchronization()
        seen["grads"].append(_grads(net))
        lr = float(gates("lr"))
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        opt.zero_grad()
        seen["at_rest"].append(_shapes(net))
    full = model.gather_full_params()
    seen["full"] = (
        {k: v.detach().clone() for k, v in full.items()} if isinstance(full, dict) else None
    )
    return seen


def tower(width: int, depth: int) -> nn.Sequential:
    """``depth`` square Linear layers without bias, GELU between them; its weights drawn in
    place (no other copy is ever made): a model whose full weights stand out in memory."""
    with torch.device("meta"):
        net = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width, False),
                                                                nn.GELU())][:-1])  # fmt: skip
    gen = torch.Generator().manual_seed(depth)
    for layer in net[::2]:
        weight = torch.empty(width, width).normal_(0.0, width**-0.5, generator=gen)
        layer.weight = nn.Parameter(weight)
    return net


def hold(student: ModuleType, width: int, depth: int, rows: int, dtype: str, steps: int) -> None:
    """``steps`` steps of plain SGD on a :func:`tower`, the broker reading the rank's memory at
    each gate (:func:`grader.scenarios.measured_gate`): before the model exists, once it is
    built, once wrapped, in each step after the forward, after the synchronization and after
    the optimizer's step, and once everything is dropped. The step's input comes through its
    gate."""
    measured_gate("start")
    net = tower(width, depth)
    measured_gate("built")
    model = student.FullyShardedDataParallel(net, compute_dtype=DTYPES[dtype])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    measured_gate("wrapped")
    for step in range(1, steps + 1):
        x = gate(f"step {step} input").float().view(rows, width)
        out = model(x)
        measured_gate(f"step {step} forward")
        out.float().pow(2).mean().backward()
        del out
        model.finish_gradient_synchronization()
        measured_gate(f"step {step} synchronized")
        opt.step()
        opt.zero_grad()
        measured_gate(f"step {step} rest")
    del model, opt, net, x
    gc.collect()
    measured_gate("end")
