"""The trusted side of the fully_sharded graded tests (``tests/graded/test_fully_sharded.py``).

The model's initial state and batch from the secret seed (each rank handed the state only
in its own shards, :func:`rank_state`), the shard arithmetic of FSDP's flat, padded layout
(``ceil(numel/p)`` elements a rank), the one-process oracle with the compute dtype's casts
where FSDP makes them (cached per optimizer, dtype and world size), the relative
error and uniform factor of a result, the gates that hand each step what it needs, and the
reading of the broker's record of every step: its events between ranks by phase and layer
(placed by the gates, never by a mark), the parameter each all-gather carries a shard of
(identified by what it carries, against the shards computed here: the initial ones in the
first step, the one-process training's after it), what each reduce-scatter carries against
the rank's local gradients at that step, the rules of the order and size of the gathers, and
what each rank's scenario returned, read into one checked record (:class:`Observed`).
No rank holds the whole model: the first step needs the other ranks' initial shards, a
later step their updated ones, and every step is judged.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from grader.broker.ops import Gate
from grader.protocol import ProtocolError
from grader.scenarios import fully_sharded as scenario
from grader.scenarios.fully_sharded import (
    DTYPES,
    SEQ,
    SHARDED,
    Net,
    build,
    loss_of,
    optimizer,
    scale_inputs,
)
from grader.testkit.data import generator
from grader.testkit.observed import (
    keys_problem,
    kind,
    per_step,
    read_every_rank,
    read_shape,
    read_tensor_or_none,
)

ROWS, STEPS = 12, 3  # ROWS: the batch, split evenly over 1, 2, 3 or 4 ranks
BASE_LR = {"sgd": 0.2, "adamw": 0.02}

# The model's layout, from one built on the CPU (a few hundred elements), the process's random
# state left as it was. Not on the meta device: its initializers there import torch's compiler
# (a second and more, paid by every run that collects these tests).
with torch.random.fork_rng(devices=[]):
    _MODEL = Net()
SHAPES = {k: v.shape for k, v in _MODEL.state_dict().items()}
NUMEL = {k: v.numel() for k, v in _MODEL.named_parameters()}
SHARDED_PARAMS = [n for n in NUMEL if n.split(".")[0] in SHARDED]
REPLICATED = [n for n in NUMEL if n not in SHARDED_PARAMS]
del _MODEL


def _drawn(gen: torch.Generator) -> dict[str, Tensor]:
    """A value for every parameter from ``gen``, at nn.Module's usual scales."""
    state = {}
    for name, shape in SHAPES.items():
        scale = 1.0 if name.startswith(("embed", "norm")) else shape[-1] ** -0.5
        base = 1.0 if name.startswith("norm") else 0.0
        state[name] = base + scale * torch.randn(shape, generator=gen) * (0.2 if base else 1)
    return state


def initial_state(p: int) -> dict[str, Tensor]:
    """The model's initial values at world size ``p``, from the secret seed: drawn afresh for
    each world size, so what a rank is handed at one (all of it, at p = 1) is of no use at
    another."""
    return _drawn(generator(f"fully_sharded/state/p{p}"))


def rank_state(p: int, r: int) -> dict[str, Tensor]:
    """The initial state as rank ``r`` is handed it: each sharded parameter holds the model's
    values only in the rank's flat shard ``[r*s, (r+1)*s)``, and elsewhere values drawn for
    this rank from the secret seed at the same scale; replicated parameters whole. The rest
    of the model reaches the rank only from the other ranks, through the broker."""
    state = initial_state(p)
    if p == 1:
        return state
    others = _drawn(generator(f"fully_sharded/others/p{p}", r))
    for name in SHARDED_PARAMS:
        s, flat = shard_size(name, p), others[name].reshape(-1)
        flat[r * s : (r + 1) * s] = state[name].reshape(-1)[r * s : (r + 1) * s]
        state[name] = flat.view(SHAPES[name])
    return state


def batch() -> tuple[Tensor, Tensor]:
    """The whole batch (tokens, targets), from the secret seed."""
    gen = generator("fully_sharded/batch")
    tokens = torch.randint(0, scenario.VOCAB, (ROWS, SEQ), generator=gen)
    return tokens, torch.randint(0, scenario.VOCAB, (ROWS, SEQ), generator=gen)


def factors() -> dict[int, float]:
    """The factor on the input of each sharded layer after the embedding, from the secret seed."""
    gen = generator("fully_sharded/factors")
    return {i: 0.75 + 0.5 * float(torch.rand((), generator=gen)) for i in range(1, len(SHARDED))}


def back_factors() -> dict[int, float]:
    """The factor on the gradient of each of those inputs, from the secret seed."""
    gen = generator("fully_sharded/back_factors")
    return {i: 0.75 + 0.5 * float(torch.rand((), generator=gen)) for i in range(1, len(SHARDED))}


def learning_rate(optimizer_name: str) -> float:
    """The step's learning rate, about the optimizer's usual one, from the secret seed."""
    gen = generator(f"fully_sharded/lr/{optimizer_name}")
    return BASE_LR[optimizer_name] * (0.8 + 0.4 * float(torch.rand((), generator=gen)))


def gates(p: int, r: int, optimizer_name: str) -> list[Gate]:
    """Rank ``r``'s gates, in the order its steps pass them: the tokens as the embedding starts,
    each later layer's factor as it starts, the targets at the loss, each of those layers'
    factor on its input's gradient as its backward has computed it (the last layer first),
    the learning rate at the optimizer's step (:func:`grader.scenarios.fully_sharded.train`)."""
    tokens, targets = (t[rows(p, r)] for t in batch())
    lr = torch.tensor([learning_rate(optimizer_name)])
    out = []
    for step in range(1, STEPS + 1):
        out.append(Gate.handing(f"step {step} tokens", tokens))
        for i, f in factors().items():
            out.append(Gate.handing(f"step {step} {SHARDED[i]}", torch.tensor([f])))
        out.append(Gate.handing(f"step {step} targets", targets))
        for i, f in sorted(back_factors().items(), reverse=True):  # backward: the last first
            out.append(Gate.handing(f"step {step} back {SHARDED[i]}", torch.tensor([f])))
        out.append(Gate.handing(f"step {step} lr", lr))
    return out


def rows(p: int, r: int) -> slice:
    """Rank ``r``'s rows of the batch: the ``p`` ranks split it evenly."""
    return slice(r * ROWS // p, (r + 1) * ROWS // p)


def shard_size(name: str, p: int) -> int:
    """The elements of a rank's flat shard of ``name``: ``ceil(numel/p)``, the last padded."""
    return math.ceil(NUMEL[name] / p)


class _Cast(nn.Module):
    """A parametrization that casts a weight to the compute dtype, as FSDP's gather does."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, weight: Tensor) -> Tensor:
        return weight.to(self.dtype)


def _model(dtype: str, p: int, start: int | None = None) -> nn.Module:
    """The model at its initial state at world size ``p`` (or as rank ``start`` is handed
    it), cast where FSDP casts to ``dtype``, with the factors."""
    net = build(initial_state(p) if start is None else rank_state(p, start))
    compute = DTYPES[dtype]
    if compute is not None:
        for name in SHARDED:
            layer = getattr(net, name)
            for param in list(dict(layer.named_parameters(recurse=False))):
                nn.utils.parametrize.register_parametrization(
                    layer, param, _Cast(compute), unsafe=True
                )
            layer.register_forward_pre_hook(
                lambda _, args, c=compute: tuple(
                    a.to(c) if a.is_floating_point() else a for a in args
                )
            )
    scale_inputs(net, factors().__getitem__, back_factors().__getitem__)
    return net


def oracle(optimizer_name: str, dtype: str, p: int, start: int | None = None) -> dict[str, Any]:
    """One process, the whole batch, from world size ``p``'s initial state (or from the state
    rank ``start`` is handed: what every rank trains if that rank's module is broadcast): the
    parameters before each step, the gradients at each step and the final parameters."""
    net = _model(dtype, p, start)
    params = dict(_plain_names(net))
    opt = optimizer(optimizer_name, list(params.values()))
    for group in opt.param_groups:
        group["lr"] = learning_rate(optimizer_name)
    tokens, targets = batch()
    grads, before = [], []
    for _ in range(STEPS):
        before.append({k: v.detach().clone() for k, v in params.items()})
        loss_of(net(tokens), targets).backward()
        grads.append({k: v.grad.detach().clone() for k, v in params.items()})
        opt.step()
        opt.zero_grad()
    full = {k: v.detach().clone() for k, v in params.items()}
    return {"grads": grads, "full": full, "before": before}


def local_grads(
    dtype: str, p: int, r: int, step: int = 1, optimizer_name: str = "sgd"
) -> dict[str, Tensor]:
    """Rank ``r``'s own gradients in step ``step``: the loss on its rows alone, at the
    parameters that the one-process training with ``optimizer_name`` has before that step."""
    net = _model(dtype, p)
    values = expected(optimizer_name, dtype, p)["before"][step - 1]
    with torch.no_grad():
        for name, param in _plain_names(net):
            param.copy_(values[name])
    tokens, targets = (t[rows(p, r)] for t in batch())
    loss_of(net(tokens), targets).backward()
    return {k: v.grad.detach().clone() for k, v in _plain_names(net)}


def _plain_names(net: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters under their unwrapped names (a parametrization's ``original`` is the weight)."""
    out = []
    for name, param in net.named_parameters():
        out.append((name.replace("parametrizations.", "").replace(".original", ""), param))
    return out


_ORACLES: dict[tuple[str, str, int, int | None], dict[str, Any]] = {}


def expected(optimizer_name: str, dtype: str, p: int, start: int | None = None) -> dict[str, Any]:
    """:func:`oracle`, computed once per optimizer, dtype, world size and start."""
    key = (optimizer_name, dtype, p, start)
    if key not in _ORACLES:
        _ORACLES[key] = oracle(*key)
    return _ORACLES[key]


def padded_shard(full: Tensor, p: int, r: int) -> Tensor:
    """Rank ``r``'s shard of ``full`` flattened and zero-padded to ``p * ceil(numel/p)``."""
    s = math.ceil(full.numel() / p)
    flat = torch.zeros(s * p, dtype=full.dtype)
    flat[: full.numel()] = full.reshape(-1)
    return flat[r * s : (r + 1) * s]


def within(got: Tensor, want: Tensor, tol: float) -> tuple[bool, float]:
    """Whether ``got`` is within ``tol`` of ``want``, relative to its largest magnitude, and
    that relative error."""
    err = float((got.double() - want.double()).abs().max()) if got.numel() else 0.0
    scale = max(float(want.double().abs().max()) if want.numel() else 0.0, 1e-3)
    return err <= tol * scale, err / scale


def mean_factor(got: Tensor, want: Tensor) -> float:
    """A uniform factor between the gradient and the mean (p when summed, not averaged)."""
    big = want.abs() > 1e-3 * float(want.abs().max() or 1)
    if not bool(big.any()):
        return 0.0
    ratio = got[big].double() / want[big].double()
    value = float(ratio.median())
    close = bool(((ratio - value).abs() <= 1e-2 * abs(value)).all())
    return value if close and abs(value - 1) > 0.05 else 0.0


Shapes = Mapping[str, tuple[int, ...]]
FIELDS = ("grads", "after_forward", "at_rest", "full")


@dataclass(frozen=True)
class Observed:
    """What a rank's :func:`grader.scenarios.fully_sharded.train` saw, read and checked here:
    each step's gradients after the synchronization (None: no ``.grad``), the parameters'
    shapes after each step's forward and between steps (before the first and after each),
    and what ``gather_full_params()`` returned at the end (None: not a dict)."""

    grads: tuple[Mapping[str, Tensor | None], ...]
    after_forward: tuple[Shapes, ...]
    at_rest: tuple[Shapes, ...]
    full: Mapping[str, Tensor] | None

    @classmethod
    def read(cls, tree: Any, steps: int, names: Collection[str]) -> Observed:
        """The record of ``tree``, a rank's return for ``steps`` steps of a model whose
        parameters are ``names``; ProtocolError unless it has exactly that structure."""
        if not isinstance(tree, dict):
            raise ProtocolError(f"{kind(tree)}, not a dict of {', '.join(FIELDS)}")
        if problem := keys_problem(tree, FIELDS, "fields"):
            raise ProtocolError(problem)
        return cls(
            per_step(tree["grads"], "grads", steps, names, read_tensor_or_none),
            per_step(tree["after_forward"], "after_forward", steps, names, read_shape),
            per_step(tree["at_rest"], "at_rest", steps + 1, names, read_shape),
            _full(tree["full"]),
        )


def _full(value: Any) -> dict[str, Tensor] | None:
    """None, or tensors by name (any names: the test says which are missing)."""
    if value is not None and not isinstance(value, dict):
        raise ProtocolError(f"full is {kind(value)}, not None or a dict")
    if value is not None and (wrong := [v for v in value.values() if not isinstance(v, Tensor)]):
        raise ProtocolError(f"full holds {kind(wrong[0])} where a tensor is due")
    return value


def observations(returned: Sequence[Any], case: str) -> list[Observed]:
    """Every rank's :class:`Observed` (:func:`~grader.testkit.observed.read_every_rank`)."""
    return read_every_rank(
        returned, lambda tree: Observed.read(tree, STEPS, NUMEL), "fully_sharded.train", case
    )
