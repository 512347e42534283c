"""The trusted side of the tensor_parallel graded tests (``tests/graded/test_tensor_parallel.py``).

The sizes of the layers and activations, the full layers, inputs and upstream gradients made
from the secret seed, the full layer run in float64 with the magnitudes its rounding scales
with, the check of a rank's value against its slice of an expected one (naming the usual
mistake a wrong value matches), each region function by its definition, the MLP's shards
and run, and the reading of the broker's record of the MLP's forward and backward (the
operations of each phase and the partial sums their all-reduces must carry).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

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
from grader.testkit.shards import check_shard

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


def output_of(seen: dict, what: str) -> Tensor:
    """The output a rank's forward returned, or why there is none (it was not a tensor)."""
    output = seen.get("output")
    require(output is not None, f"{what}: forward returned a {seen['output_type']}, not a tensor")
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

    def check(r: int) -> None:
        for role, layer, full in (
            ("fc1", "ColumnParallelLinear", {"weight": w1, "bias": b1}),
            ("fc2", "RowParallelLinear", {"weight": w2, "bias": b2}),
        ):
            seen = shards.returned[r][role]
            kind = f"{layer} (its {role}, {layer[:3].lower()} parallel)"
            require(seen is not None, f"ParallelMLP.from_linears: the MLP holds no {kind}")
            check_shard(seen, full, layer, world.size, r, f"ParallelMLP.from_linears: {role}")

    on_every_rank(world.size, check)
    args = [((w1, b1), (w2, b2), tuple(x.shape)) for _ in range(world.size)]
    # The input is handed over at the gate "forward", the output's gradient at "backward".
    gates = [[Gate.handing("forward", x), Gate.handing("backward", grad)]] * world.size
    out = world.call(scenario="tensor_parallel.mlp_forward_backward", args=args, gates=gates)
    return {"w1": w1, "b1": b1, "w2": w2, "b2": b2}, x, grad, out


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
