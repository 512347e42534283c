"""The trusted side of the fully_sharded graded tests (``tests/graded/test_fully_sharded.py``).

The model's initial state and batch from the secret seed, the shard arithmetic of FSDP's
flat, padded layout (``ceil(numel/p)`` elements a rank), the one-process oracle with the
compute dtype's casts where FSDP makes them (cached per optimizer and dtype), the relative
error and uniform factor of a result, and the reading of the broker's record of one step:
its events by phase and layer, the parameter each all-gather carries a shard of, and the
rules of the order and size of the gathers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from grader.broker.traffic import Event
from grader.judge.call import CallResult
from grader.scenarios import fully_sharded as scenario
from grader.scenarios.fully_sharded import DTYPES, SHARDED, Net, build, loss_of, optimizer
from grader.testkit.compare import require
from grader.testkit.data import generator

ROWS, SEQ, STEPS = 12, 5, 3  # ROWS: the batch, split evenly over 1, 2, 3 or 4 ranks


def initial_state() -> dict[str, Tensor]:
    """The model's initial values, from the secret seed, at nn.Module's usual scales."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Net().state_dict().items()}
    gen = generator("fully_sharded/state")
    state = {}
    for name, shape in shapes.items():
        scale = 1.0 if name.startswith(("embed", "norm")) else shape[-1] ** -0.5
        base = 1.0 if name.startswith("norm") else 0.0
        state[name] = base + scale * torch.randn(shape, generator=gen) * (0.2 if base else 1)
    return state


def batch() -> tuple[Tensor, Tensor]:
    """The whole batch (tokens, targets), from the secret seed."""
    gen = generator("fully_sharded/batch")
    tokens = torch.randint(0, scenario.VOCAB, (ROWS, SEQ), generator=gen)
    return tokens, torch.randint(0, scenario.VOCAB, (ROWS, SEQ), generator=gen)


def rows(p: int, r: int) -> slice:
    """Rank ``r``'s rows of the batch: the ``p`` ranks split it evenly."""
    return slice(r * ROWS // p, (r + 1) * ROWS // p)


with torch.device("meta"):
    NUMEL = {k: v.numel() for k, v in Net().named_parameters()}
SHARDED_PARAMS = [n for n in NUMEL if n.split(".")[0] in SHARDED]
REPLICATED = [n for n in NUMEL if n not in SHARDED_PARAMS]


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


def oracle(optimizer_name: str, dtype: str) -> dict[str, Any]:
    """One process, the whole batch: the gradients at each step and the final parameters."""
    net = build(initial_state())
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
    params = dict(_plain_names(net))
    opt = optimizer(optimizer_name, list(params.values()))
    tokens, targets = batch()
    grads = []
    for _ in range(STEPS):
        loss_of(net(tokens), targets).backward()
        grads.append({k: v.grad.detach().clone() for k, v in params.items()})
        opt.step()
        opt.zero_grad()
    return {"grads": grads, "full": {k: v.detach().clone() for k, v in params.items()}}


def _plain_names(net: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters under their unwrapped names (a parametrization's ``original`` is the weight)."""
    out = []
    for name, param in net.named_parameters():
        out.append((name.replace("parametrizations.", "").replace(".original", ""), param))
    return out


_ORACLES: dict[tuple[str, str], dict[str, Any]] = {}


def expected(optimizer_name: str, dtype: str) -> dict[str, Any]:
    """:func:`oracle`, computed once per optimizer and dtype."""
    key = (optimizer_name, dtype)
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


# -- the broker's record ---------------------------------------------------------------------


def phases(events: Sequence[Event]) -> dict[str, list[tuple[str, Event]]]:
    """The rank's events of the first step, by phase, each with the last layer mark before it."""
    out: dict[str, list[tuple[str, Event]]] = {"forward": [], "backward": [], "finish": []}
    phase, layer = "", ""
    for e in events:
        if e.op == "mark":
            if e.at in out:
                phase, layer = e.at, ""
            elif e.at == "step":
                break
            else:
                layer = e.at
                out.setdefault(phase, []).append((layer, e))
            continue
        if phase in out:
            out[phase].append((layer, e))
    return out


def gathered(e: Event, p: int, itemsize: dict[str, int]) -> str | None:
    """The sharded parameter whose one shard an all-gather carries (sizes are all distinct)."""
    size = itemsize.get(e.dtype, 0)
    for name in SHARDED_PARAMS:
        if size and e.nbytes == shard_size(name, p) * size:
            return name
    return None


ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def check_record(out: CallResult, r: int, p: int, dtype: str, kind: str) -> dict[str, Any]:
    """The broker's facts for rank ``r``; fails with the first broken rule of ``kind``."""
    events = out.traffic.per_rank[r]
    by_phase = phases(events)
    want_dtype = dtype
    layer_of = {n: SHARDED.index(n.split(".")[0]) for n in SHARDED_PARAMS}
    fwd = [(mark, e) for mark, e in by_phase["forward"] if e.op != "mark"]
    bwd = [(mark, e) for mark, e in by_phase["backward"] if e.op != "mark"]
    for phase, items in (("forward", fwd), ("backward", bwd)):
        for _, e in items:
            if e.op != "all_gather":
                continue
            name = gathered(e, p, ITEMSIZE)
            require(
                name is not None and e.dtype == want_dtype,
                f"the {phase}'s all-gather at {e.at or '?'} carries {e.nbytes} bytes of "
                f"{e.dtype}: each gather must carry exactly one shard of one sharded parameter "
                f"in the compute dtype ({want_dtype})"
                + (", cast BEFORE communicating" if e.dtype != want_dtype else ""),
            )
    # Every layer's forward is preceded by the gathers of its parameters.
    done: list[str] = []
    seen_layers = []
    for mark, e in by_phase["forward"]:
        if e.op == "mark":
            i = int(mark.split()[-1])
            seen_layers.append(i)
            mine = [n for n in SHARDED_PARAMS if layer_of[n] == i]
            lacking = [n for n in mine if n not in done]
            require(
                not lacking,
                f"{SHARDED[i]} computed its forward before {', '.join(lacking)} was gathered",
            )
            ahead = {layer_of[n] for n in done if layer_of[n] > i + 2}
            if kind == "communication":
                require(
                    not ahead,
                    f"when {SHARDED[i]} starts its forward, layer(s) "
                    f"{', '.join(SHARDED[j] for j in sorted(ahead))} are gathered already: "
                    "prefetch at most two layers ahead, not everything up front",
                )
        elif e.op == "all_gather":
            done.append(gathered(e, p, ITEMSIZE) or "?")
    require(seen_layers == list(range(len(SHARDED))), "the grader's layer marks are missing")
    order = [layer_of[n] for n in done if n in layer_of]
    if kind == "communication":
        require(
            order == sorted(order),
            f"the forward gathers the layers in the order {[SHARDED[i] for i in order]}, not "
            "in forward order",
        )
    # Every Linear's backward is preceded by its weight's gather, in reverse order.
    back: list[str] = []
    for _, e in by_phase["backward"]:
        if e.op == "all_gather":
            back.append(gathered(e, p, ITEMSIZE) or "?")
    linear_weights = [f"{m}.weight" for m in SHARDED if m != "embed"]
    missing = [n for n in linear_weights if n not in back]
    require(
        not missing,
        f"the backward gathers no {', '.join(missing)}: a Linear's backward needs its full "
        "weight, which must have been freed after forward and is gathered again",
    )
    back_layers = [layer_of[n] for n in back]
    if kind == "communication":
        require(
            back_layers == sorted(back_layers, reverse=True),
            f"the backward gathers the layers in the order {[SHARDED[i] for i in back_layers]}: "
            "backward runs the layers in reverse, and gathers them so",
        )
    return {"forward": done, "backward": back}
