"""The trusted side of the tensor_parallel graded tests (``tests/graded/test_tensor_parallel.py``).

The sizes of the layers and activations, the full layers, inputs and upstream gradients made
from the secret seed, the full layer run in float64 with the magnitudes its rounding scales
with, the check of a rank's value against its slice of an expected one (naming the usual
mistake a wrong value matches), each region function by its definition, the MLP's shards
and run, the reading of the broker's record of the MLP's forward and backward (the
operations of each phase and the partial sums their all-reduces must carry), and what each
rank's scenario returned, read into one checked record (:class:`LayerRun`,
:class:`RegionRun`, :class:`MlpShards`, :class:`MlpRun`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

from grader import failures
from grader.broker.ops import Gate
from grader.broker.traffic import Event
from grader.judge.call import CallResult
from grader.launch.world import World
from grader.scenarios.tensor_parallel import linear
from grader.testkit.compare import check_close, on_every_rank, require
from grader.testkit.data import rank_tensor
from grader.testkit.observed import (
    or_none,
    read_bool,
    read_every_rank,
    read_field,
    read_fields,
    read_tensor,
    read_text,
    read_value,
)
from grader.testkit.shards import HELD, Held, Shard, check_shard

IN, OUT, FFN = 8, 12, 16  # divisible by 1, 2 and 4
SHAPE = (2, 3)  # leading dimensions of every activation: 6 rows
ALL = slice(None)
Pair = tuple[Tensor, Tensor]  # an expected value and the magnitude its rounding scales with
Why = dict[str, Tensor]  # what a tensor would hold after each usual mistake, by its hint


def weights(key: str, n_in: int, n_out: int) -> tuple[Tensor, Tensor]:
    """A full layer's weight and bias, drawn from the secret seed at nn.Linear's scale."""
    weight = rank_tensor(f"{key}/weight", 0, (n_out, n_in), torch.float32) * n_in**-0.5
    return weight, rank_tensor(f"{key}/bias", 0, (n_out,), torch.float32) * 0.5


def shared(key: str, features: int) -> Tensor:
    """The same activation (or upstream gradient) on every rank."""
    return rank_tensor(key, 0, (*SHAPE, features), torch.float32)


def call(world: World, scenario: str, args: list, case: str) -> CallResult:
    """``world.call`` of a scenario; autograd's refusal of a backward's gradient says why."""
    try:
        return world.call(scenario=f"tensor_parallel.{scenario}", args=args, case=case)
    except failures.StudentError as err:
        if "returned an invalid gradient" not in str(err):
            raise
        raise err.with_hint(
            "a backward returns a gradient of its input's shape: "
            "scatter_to_parallel_region's backward all-gathers the ranks' gradients along the "
            "last dimension, gather_from_parallel_region's keeps this rank's slice of it"
        ) from err


def full_run(weight: Tensor, bias: Tensor, x: Tensor, grad: Tensor) -> dict[str, Pair]:
    """The full layer's output and gradients in float64, with the magnitudes of their rounding."""
    layer, x = linear(weight.double(), bias.double()), x.double().requires_grad_()
    y = layer(x)
    y.backward(grad.double())
    w, g2, x2 = weight.double().abs(), grad.double().abs().flatten(0, -2), x.detach().abs()
    return {
        "output": (y.detach().float(), x2 @ w.T + bias.double().abs()),
        "input": (x.grad.float(), grad.double().abs() @ w),
        "weight": (layer.weight.grad.float(), g2.T @ x2.flatten(0, -2)),
        "bias": (layer.bias.grad.float(), g2.sum(0)),
    }


def expect(
    got: Tensor | None, pair: Pair, index: Any, what: str, terms: int, why: Why | None = None
) -> None:
    """``got`` equals ``pair[0][index]`` within the rounding bound of magnitude ``pair[1]``."""
    require(got is not None, f"{what} is missing (.grad is None)")
    explanations = {reason: value[index] for reason, value in (why or {}).items()}
    want, magnitude = pair[0][index], pair[1][index]
    check_close(got, want, what, magnitude=magnitude, terms=terms, explanations=explanations)


def output_of(seen: LayerRun | RegionRun | MlpRun, what: str) -> Tensor:
    """The output a rank's forward returned, or why there is none (it was not a tensor)."""
    output = seen.output
    require(output is not None, f"{what}: forward returned a {seen.output_type}, not a tensor")
    return output


def region_definition(
    function: str, xs: list[Tensor], grads: list[Tensor], rank: int, n: int
) -> tuple[Pair, Why, Pair, Why]:
    """Output and input gradient by the definition (with magnitudes), and the usual mistakes."""
    mine = slice(rank * n, (rank + 1) * n)
    xs, grads = [t.double() for t in xs], [t.double() for t in grads]
    x_sum, x_mag = sum(xs), sum(t.abs() for t in xs)
    g_sum, g_mag = sum(grads), sum(t.abs() for t in grads)
    x, g = xs[rank], grads[rank]

    def pair(value: Tensor, magnitude: Tensor) -> Pair:
        return value.float(), magnitude

    p = len(xs)
    averaged = f"it is 1/{p} of the sum over ranks: the all-reduce sums, never averages"
    if function == "copy_to_parallel_region":
        y_why = {"it is the sum over ranks: the forward is the identity": x_sum}
        g_why = {"it is this rank's own gradient: the backward all-reduces it": g}
        g_why[averaged] = g_sum / p
        return pair(x, x.abs()), y_why, pair(g_sum, g_mag), g_why
    if function == "reduce_from_parallel_region":
        y_why = {"it is this rank's input: the forward all-reduces it": x, averaged: x_sum / p}
        g_why = {"it is the sum over ranks: the backward is the identity": g_sum}
        return pair(x_sum, x_mag), y_why, pair(g, g.abs()), g_why
    if function == "gather_from_parallel_region":
        y = torch.cat(xs, -1)
        return pair(y, y.abs()), {}, pair(g[:, mine], g[:, mine].abs()), {}
    spread = torch.zeros(2, n * len(xs), dtype=torch.float64)
    spread[:, mine] = g
    g_all = torch.cat(grads, -1)
    g_why = {"only this rank's slice, zeros elsewhere: the backward all-gathers": spread}
    return pair(x[:, mine], x[:, mine].abs()), {}, pair(g_all, g_all.abs()), g_why


def mlp_call(world: World) -> tuple[dict[str, Tensor], Tensor, Tensor, CallResult]:
    """``ParallelMLP.from_linears(fc1, fc2)`` run on every rank on the same input."""
    (w1, b1), (w2, b2) = weights("fc1", IN, FFN), weights("fc2", FFN, IN)
    x, grad = shared("mlp/x", IN), shared("mlp/grad", IN)
    shards = world.call(
        scenario="tensor_parallel.mlp_shards",
        args=[((w1, b1), (w2, b2))] * world.size,
        case="from_linears",
    )
    held = observed(shards.returned, MlpShards.read, "mlp_shards", "from_linears")

    def check(r: int) -> None:
        for seen, role, layer, full in (
            (held[r].fc1, "fc1", "ColumnParallelLinear", {"weight": w1, "bias": b1}),
            (held[r].fc2, "fc2", "RowParallelLinear", {"weight": w2, "bias": b2}),
        ):
            kind = f"{layer} (its {role}, {layer[:3].lower()} parallel)"
            require(seen is not None, f"ParallelMLP.from_linears: the MLP holds no {kind}")
            check_shard(seen, full, layer, world.size, r, f"ParallelMLP.from_linears: {role}")

    on_every_rank(world.size, check)
    args = [((w1, b1), (w2, b2), tuple(x.shape)) for _ in range(world.size)]
    # The input is handed over at the gate "forward", the output's gradient at "backward".
    gates = [[Gate.handing("forward", x), Gate.handing("backward", grad)]] * world.size
    out = world.call(scenario="tensor_parallel.mlp_forward_backward", args=args, gates=gates)
    return {"w1": w1, "b1": b1, "w2": w2, "b2": b2}, x, grad, out


def mlp_runs(out: CallResult) -> list[MlpRun]:
    """Every rank's :class:`MlpRun` of ``out``, the MLP's call (:func:`mlp_call`)."""
    return observed(out.returned, MlpRun.read, "mlp_forward_backward", "")


def phase_operations(out: CallResult, rank: int) -> dict[str, Counter]:
    """How many of each operation the broker carried for ``rank`` in each phase."""
    return {phase: Counter(e.op for e in made) for phase, made in phase_events(out, rank).items()}


def phase_events(out: CallResult, rank: int) -> dict[str, list[Event]]:
    """The operations the broker carried for ``rank`` in the MLP's forward and its backward.

    The operations, their names and their count are the broker's own record, collectives of
    every rank only (the MLP's group: the default one); so is where
    the rank passed the gates that hand over the input ("forward") and the output's gradient
    ("backward"): no operation that needs either can come before its gate.
    """
    traffic = out.traffic
    started = traffic.split_at_gate(rank, "forward")
    backward = traffic.split_at_gate(rank, "backward")
    require(
        started is not None and backward is not None,
        f"rank {rank}: it never reached the grader's gates around the MLP's forward and backward",
    )
    forward = backward[0][len(started[0]) :]
    # A collective of a smaller group than the MLP's (of one: it never left the rank) is none.
    return {
        "forward": [e for e in forward if traffic.among_all(e)],
        "backward": [e for e in backward[1] if traffic.among_all(e)],
    }


def partial_sums(full: dict[str, Tensor], x: Tensor, grad: Tensor, p: int, r: int) -> dict:
    """What rank ``r``'s all-reduce carries in each phase, in float64: its partial output (fc2
    applied to its shard of the hidden layer) forward, its partial input gradient backward."""
    w1, b1, w2 = (full[k].double() for k in ("w1", "b1", "w2"))
    rows = slice(r * FFN // p, (r + 1) * FFN // p)
    h = (x.double() @ w1[rows].T + b1[rows]).requires_grad_()
    a = F.gelu(h)
    a.backward(grad.double() @ w2[:, rows])
    return {"forward": a.detach() @ w2[:, rows].T, "backward": h.grad @ w1[rows]}


# -- what each rank's scenario returned, read into one checked record -------------------------

R = TypeVar("R")
RAN = ("output_type", "output", "input_grad")  # every run's: forward's result, input's gradient
GRAD = or_none(read_tensor)
MLP_GRADS = ("fc1 weight", "fc1 bias", "fc2 weight", "fc2 bias")


@dataclass(frozen=True)
class RegionRun:
    """What a rank's forward and backward saw: the type the forward returned, its output
    (None: not a tensor) and the input's gradient (None: no ``.grad``)."""

    output_type: str
    output: Tensor | None
    input_grad: Tensor | None

    @classmethod
    def read(cls, tree: Any) -> RegionRun:
        """The record of ``tree``; ProtocolError unless it has exactly that structure."""
        read_fields(tree, RAN)
        return cls(*_ran(tree))


def _ran(tree: dict[str, Any]) -> tuple[str, Tensor | None, Tensor | None]:
    """The fields :data:`RAN` of ``tree``, read."""
    return (
        read_field(tree, "output_type", read_text),
        read_field(tree, "output", GRAD),
        read_field(tree, "input_grad", GRAD),
    )


@dataclass(frozen=True)
class LayerRun:
    """What a rank's :func:`grader.scenarios.tensor_parallel.column_forward_backward` (or
    ``row_``) saw: the layer's tensors, its forward and backward (as :class:`RegionRun`) and
    its weight's and bias's gradients (None: no ``.grad``)."""

    held: Held
    output_type: str
    output: Tensor | None
    input_grad: Tensor | None
    weight_grad: Tensor | None
    bias_grad: Tensor | None

    @classmethod
    def read(cls, tree: Any) -> LayerRun:
        """The record of ``tree``; ProtocolError unless it has exactly that structure."""
        read_fields(tree, (*HELD, *RAN, "weight_grad", "bias_grad"))
        grads = (read_field(tree, name, GRAD) for name in ("weight_grad", "bias_grad"))
        return cls(Held.read(tree), *_ran(tree), *grads)


@dataclass(frozen=True)
class MlpShards:
    """What a rank's :func:`grader.scenarios.tensor_parallel.mlp_shards` saw: the MLP's fc1
    and fc2 as ``from_linears`` built them (None: the MLP holds no such layer)."""

    fc1: Shard | None
    fc2: Shard | None

    @classmethod
    def read(cls, tree: Any) -> MlpShards:
        """The record of ``tree``; ProtocolError unless it has exactly that structure."""
        read_fields(tree, ("fc1", "fc2"))
        return cls(*(None if tree[k] is None else Shard.read(tree[k]) for k in ("fc1", "fc2")))


@dataclass(frozen=True)
class MlpRun:
    """What a rank's :func:`grader.scenarios.tensor_parallel.mlp_forward_backward` saw: whether
    the MLP holds a column and a row parallel layer, its forward and backward (as
    :class:`RegionRun`) and the layers' gradients by :data:`MLP_GRADS`' names."""

    has_column: bool
    has_row: bool
    output_type: str
    output: Tensor | None
    input_grad: Tensor | None
    grads: Mapping[str, Tensor | None]

    @classmethod
    def read(cls, tree: Any) -> MlpRun:
        """The record of ``tree``; ProtocolError unless it has exactly that structure."""
        read_fields(tree, ("has_column", "has_row", *RAN, *MLP_GRADS))
        found = (read_field(tree, name, read_bool) for name in ("has_column", "has_row"))
        grads = {name: read_field(tree, name, GRAD) for name in MLP_GRADS}
        return cls(*found, *_ran(tree), grads)


def raised(value: Any) -> str | None:
    """What a rank's :func:`grader.scenarios.tensor_parallel.construct` returned: the message
    of the ValueError it raised, or None; ProtocolError otherwise."""
    return read_value(value, "what it raised", or_none(read_text))


def observed(
    returned: Sequence[Any], read: Callable[[Any], R], scenario: str, case: str
) -> list[R]:
    """Every rank's record of ``scenario`` (:func:`~grader.testkit.observed.read_every_rank`)."""
    return read_every_rank(returned, read, f"tensor_parallel.{scenario}", case)
