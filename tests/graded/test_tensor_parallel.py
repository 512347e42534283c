"""Graded tests of ``assignments/tensor_parallel.py``: Megatron-style tensor parallelism.

The full ``nn.Linear`` layers, their inputs and upstream gradients are made here from the
secret seed and sent to every rank; each rank shards them with the submission's
``from_linear``/``from_linears``, runs one forward and backward (the scenarios in
``grader/scenarios/tensor_parallel.py``) and sends back what it got, which is compared
with the full layers run here in float64, within the float32 rounding bound of
``check_close``:

- ``column_parallel_linear``, ``row_parallel_linear``: first ``from_linear`` alone, the
  shard each rank holds (rows, resp. columns ``[r*n/p, (r+1)*n/p)`` of the weight), with
  the float64 layer's shard in float64; then the output's shape and values, and the
  gradients of the input, the weight and the bias, with both settings of
  ``gather_output``, resp. ``input_is_parallel``. A wrong shard or shape is named with
  the dimension that is split and why, before it can break a matmul.
- ``region_function``: each of the four autograd functions, forward and backward, against
  its definition, with a different non-contiguous input and upstream gradient on every rank.
- ``parallel_mlp``: ``ParallelMLP.from_linears(fc1, fc2)`` against ``fc2(gelu(fc1(x)))``.
- ``parallel_mlp_communication``: the broker's record of each rank's operations during the
  MLP's forward and during its backward is exactly one all-reduce each, and nothing else:
  that is what the column-then-row split is for.
- ``indivisible_dimension``: a split dimension that p does not divide raises ``ValueError``
  naming it (at p = 1 every size divides, and construction must simply work).

A wrong value is explained where a usual mistake accounts for it: a bias added on every
rank, a gradient that was not all-reduced, or averaged (1/p of the sum), a gradient slice
that was not all-gathered, a rank holding another rank's shard.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from grader.scenarios.tensor_parallel import linear
from grader.testkit import (
    CallResult,
    Event,
    TestRecord,
    World,
    check_close,
    check_unchanged,
    failures,
    on_every_rank,
    rank_tensor,
    require,
)
from grader.testkit.shards import block, check_shape, check_shard, check_shards, check_still_holds

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
    output = seen.get("output")
    require(output is not None, f"{what}: forward returned a {seen['output_type']}, not a tensor")
    return output


@pytest.mark.graded(target="tensor_parallel.ColumnParallelLinear", kind="correctness")
@pytest.mark.parametrize("setting", ["gather_output=False", "gather_output=True"])
def test_column_parallel_linear(world: World, setting: str) -> None:
    p, gather = world.size, setting.endswith("=True")  # the setting names the test
    what = f"ColumnParallelLinear(gather_output={gather}) on {p} ranks"
    weight, bias = weights("col", IN, OUT)
    x, grad = shared("col/x", IN), shared("col/grad", OUT)
    full = check_shards(world, "ColumnParallelLinear", weight, bias, setting)
    run = full_run(weight, bias, x, grad)
    outs = [(..., ALL if gather else block(p, r, OUT)) for r in range(p)]
    shape = (*SHAPE, OUT if gather else OUT // p)
    why = (
        f"gather_output=True concatenates the {p} ranks' slices of {OUT // p} output features "
        f"along the last dimension, in rank order, into all {OUT}"
        if gather
        else f"gather_output=False leaves each rank its out_features/p = {OUT}/{p} = {OUT // p} "
        "output features"
    )
    args = [(weight, bias, x, grad[outs[r]].clone(), gather) for r in range(p)]
    out = call(world, "column_forward_backward", args, setting)
    fix = "copy_to_parallel_region must all-reduce the input's gradient in backward"

    def check(r: int) -> None:
        seen, rows = out.returned[r], block(p, r, OUT)
        check_still_holds(seen, full, "ColumnParallelLinear", p, r)
        check_shape(output_of(seen, what), shape, what, why)
        expect(output_of(seen, what), run["output"], outs[r], f"{what}: output", IN + 1)
        why_grad = {
            f"this rank's partial sum only: {fix}": grad[..., rows].double()
            @ weight[rows].double(),
            f"{p}x the expected: {fix} once": p * run["input"][0],
            f"1/{p} of the expected: {fix}, summing the ranks' gradients, not averaging them": (
                run["input"][0] / p
            ),
        }
        expect(
            seen["input_grad"], run["input"], ALL, f"{what}: the input's gradient", OUT, why_grad
        )
        expect(seen["weight_grad"], run["weight"], rows, f"{what}: weight gradient", 6)
        expect(seen["bias_grad"], run["bias"], rows, f"{what}: bias gradient", 6)

    on_every_rank(p, check)


@pytest.mark.graded(target="tensor_parallel.RowParallelLinear", kind="correctness")
@pytest.mark.parametrize("setting", ["input_is_parallel=True", "input_is_parallel=False"])
def test_row_parallel_linear(world: World, setting: str) -> None:
    p, parallel = world.size, setting.endswith("=True")  # the setting names the test
    what = f"RowParallelLinear(input_is_parallel={parallel}) on {p} ranks"
    weight, bias = weights("row", IN, OUT)
    x_full, grad = shared("row/x", IN), shared("row/grad", OUT)
    full = check_shards(world, "RowParallelLinear", weight, bias, setting)
    run = full_run(weight, bias, x_full, grad)
    cols = [block(p, r, IN) for r in range(p)]
    reduced = (
        f"the {p} ranks' partial products, each of shape {(*SHAPE, OUT)}, are summed by the "
        "all-reduce, not concatenated or split"
    )
    xs = [(x_full[..., cols[r]] if parallel else x_full).clone() for r in range(p)]
    args = [(weight, bias, xs[r], grad, parallel) for r in range(p)]
    out = call(world, "row_forward_backward", args, setting)
    w64, b64, x64 = weight.double(), bias.double(), x_full.double()

    def check(r: int) -> None:
        seen, mine = out.returned[r], cols[r]
        check_still_holds(seen, full, "RowParallelLinear", p, r)
        check_shape(output_of(seen, what), (*SHAPE, OUT), what, reduced)
        why = {
            "the bias is added on every rank before the reduction: the output is off by (p-1) x "
            f"bias = {p - 1} x bias; add it once, after the all-reduce": run["output"][0]
            + (p - 1) * b64,
            "this rank's partial product only: reduce_from_parallel_region must all-reduce the "
            "partial products in forward": x64[..., mine] @ w64[:, mine].T + b64,
            f"the partial products were averaged (1/{p} of their sum), then the bias added: "
            "reduce_from_parallel_region's all-reduce sums them": (run["output"][0] - b64) / p
            + b64,
        }
        expect(output_of(seen, what), run["output"], ALL, f"{what}: output", IN + 1, why)
        only_mine = torch.zeros_like(x64)
        only_mine[..., mine] = run["input"][0][..., mine].double()
        why = {
            "only this rank's slice, zeros elsewhere: scatter_to_parallel_region must "
            "all-gather the gradient in backward": only_mine,
            f"{p}x the expected: reduce_from_parallel_region's backward must be the identity": p
            * run["input"][0],
        }
        index = (..., mine if parallel else ALL)
        expect(seen["input_grad"], run["input"], index, f"{what}: the input's gradient", OUT, why)
        expect(seen["weight_grad"], run["weight"], (ALL, mine), f"{what}: weight gradient", 6)
        expect(seen["bias_grad"], run["bias"], ALL, f"{what}: bias gradient", 6)

    on_every_rank(p, check)


SHAPES = {  # why each region function's output has its shape, from a (2, n) input per rank
    "copy_to_parallel_region": lambda p, n: "the forward is the identity",
    "reduce_from_parallel_region": lambda p, n: "the all-reduce sums the ranks' tensors",
    "gather_from_parallel_region": lambda p, n: (
        f"the all-gather concatenates the {p} ranks' "
        f"(2, {n}) tensors along the last dimension, in rank order"
    ),
    "scatter_to_parallel_region": lambda p, n: (
        f"each rank keeps its {n} of the {n * p} columns of the last dimension"
    ),
}
FUNCTIONS = [f"{verb}_parallel_region" for verb in ("copy_to", "reduce_from", "gather_from")]
FUNCTIONS.append("scatter_to_parallel_region")


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


@pytest.mark.graded(target="tensor_parallel.{function}", kind="correctness")
@pytest.mark.parametrize("function", FUNCTIONS)
def test_region_function(world: World, function: str) -> None:
    p, n, what = world.size, 3, f"{function} on {world.size} ranks"
    width = n * p if function.startswith("scatter") else n
    # Every rank's input differs, and is every other element of its storage.
    xs = [rank_tensor(function, r, (2, width), torch.float32, contiguous=False) for r in range(p)]
    shape = (2, n * p) if function.startswith("gather") else (2, n)
    grads = [rank_tensor(function + "/grad", r, shape, torch.float32) for r in range(p)]
    args = [(function, xs[r], grads[r]) for r in range(p)]
    out = call(world, "region_forward_backward", args, function)

    def check(r: int) -> None:
        seen = out.returned[r]
        check_unchanged(out.args[r][1], xs[r], f"{what}: its input x")
        y_want, y_why, g_want, g_why = region_definition(function, xs, grads, r, n)
        check_shape(output_of(seen, what), tuple(y_want[0].shape), what, SHAPES[function](p, n))
        expect(output_of(seen, what), y_want, ALL, f"{what}, forward: output", p, y_why)
        got = seen["input_grad"]
        expect(got, g_want, ALL, f"{what}, backward: the input's gradient", p, g_why)

    on_every_rank(p, check)


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
    args = [((w1, b1), (w2, b2), x, grad) for _ in range(world.size)]
    out = world.call(scenario="tensor_parallel.mlp_forward_backward", args=args)
    return {"w1": w1, "b1": b1, "w2": w2, "b2": b2}, x, grad, out


@pytest.mark.graded(target="tensor_parallel.ParallelMLP", kind="correctness")
def test_parallel_mlp(world: World) -> None:
    p, what = world.size, f"ParallelMLP on {world.size} ranks"
    full, x32, grad32, out = mlp_call(world)
    w1, b1, w2, b2 = (full[k].double() for k in ("w1", "b1", "w2", "b2"))
    x, grad = x32.double(), grad32.double()
    a, b, x_ref = linear(w1, b1), linear(w2, b2), x.clone().requires_grad_()
    y_want = b(F.gelu(a(x_ref)))
    y_want.backward(grad)
    # Rounding bounds: |GELU'| <= 1.13, so 1.2 x the magnitude of fc1's output covers GELU's.
    m_h = 1.2 * (x.abs() @ w1.abs().T + b1.abs())
    m_gh = 1.2 * (grad.abs() @ w2.abs())
    g_rows, gh_rows = grad.abs().reshape(-1, IN), m_gh.reshape(-1, FFN)
    explanations = {
        f"fc2's bias is added on every rank before the reduction: the output is off by (p-1) x "
        f"bias = {p - 1} x bias": y_want.detach() + (p - 1) * b2,
        "GELU used the tanh approximation, use the exact one (nn.GELU())": b(
            F.gelu(a(x), approximate="tanh")
        ).detach(),
    }
    magnitude, terms = m_h @ w2.abs().T + b2.abs(), IN + FFN + 8
    twice = f"{p}x the expected: an all-reduce too many in backward"
    layers = (
        ("fc1 weight", (a.weight.grad, gh_rows.T @ x.abs().reshape(-1, IN)), "rows"),
        ("fc1 bias", (a.bias.grad, gh_rows.sum(0)), "rows"),
        ("fc2 weight", (b.weight.grad, g_rows.T @ m_h.reshape(-1, FFN)), "cols"),
        ("fc2 bias", (b.bias.grad, g_rows.sum(0)), "all"),
    )

    def check(r: int) -> None:
        seen, rows = out.returned[r], block(p, r, FFN)
        for found, cls, role in (("has_column", "Column", "fc1"), ("has_row", "Row", "fc2")):
            kind = f"{cls}ParallelLinear (its {role}, {cls.lower()} parallel)"
            require(seen[found], f"ParallelMLP.from_linears: the MLP holds no {kind}")
        y = output_of(seen, what)
        expect(y, (y_want.detach().float(), magnitude), ALL, f"{what}: output", terms, explanations)
        x_mine = x.clone().requires_grad_()  # what this rank's shards alone give the input
        mine = F.linear(F.gelu(F.linear(x_mine, w1[rows], b1[rows])), w2[:, rows])
        (partial,) = torch.autograd.grad(mine, x_mine, grad)
        why = {
            twice: p * x_ref.grad,
            "this rank's partial sum only: it must be all-reduced": partial,
        }
        pair = (x_ref.grad.float(), m_gh @ w1.abs())
        expect(seen["input_grad"], pair, ALL, f"{what}: the input's gradient", terms, why)
        for name, (want, mag), split in layers:
            index = {"rows": rows, "cols": (ALL, rows), "all": ALL}[split]
            pair, why = (want.float(), mag), {twice: p * want}
            expect(seen[name], pair, index, f"{what}: {name} gradient", terms, why)

    on_every_rank(p, check)


WHY_ONCE = {
    "forward": "one all-reduce of fc2's partial outputs (fc1's output stays sharded, GELU needs "
    "no communication)",
    "backward": "one all-reduce of the input's gradient (copy_to_parallel_region before fc1)",
}


def phase_operations(out: CallResult, rank: int) -> dict[str, Counter]:
    """How many of each operation the broker carried for ``rank`` in each phase."""
    return {phase: Counter(e.op for e in made) for phase, made in phase_events(out, rank).items()}


def phase_events(out: CallResult, rank: int) -> dict[str, list[Event]]:
    """The operations the broker carried for ``rank`` in the MLP's forward and its backward.

    The operations, their names and their count are the broker's own record (trusted);
    where the forward ends and the backward begins comes from the marks the rank's
    scenario posted around ``mlp(x)`` and ``y.backward()``.
    """
    events = out.traffic.per_rank[rank]
    at = {label: i for i, label in out.traffic.marks(rank)}
    require(
        {"forward", "backward", "end"} <= set(at),
        f"rank {rank}: the grader's marks around the MLP's forward and backward are missing",
    )
    phases = {"forward": (at["forward"], at["backward"]), "backward": (at["backward"], at["end"])}
    return {
        phase: [e for e in events[start + 1 : stop] if e.op != "mark"]
        for phase, (start, stop) in phases.items()
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


def carried(event: Event) -> Tensor:
    """The tensor a collective's input carried, as the broker received it."""
    dtype = getattr(torch, event.dtype or "float32")
    return torch.frombuffer(bytearray(event.payload), dtype=dtype).double()


@pytest.mark.graded(target="tensor_parallel.ParallelMLP", kind="communication")
def test_parallel_mlp_communication(world: World, record: TestRecord) -> None:
    p = world.size
    full, x, grad, out = mlp_call(world)
    record.details["all_reduces"] = [
        len(out.traffic.collectives(r, "all_reduce")) for r in range(p)
    ]
    calls = [phase_operations(out, r) for r in range(p)]
    record.details["forward_calls"] = dict(calls[0]["forward"])
    record.details["backward_calls"] = dict(calls[0]["backward"])

    def check(r: int) -> None:
        for phase, made in calls[r].items():
            listed = ", ".join(f"{op} x{n}" for op, n in sorted(made.items()))
            require(
                made == Counter(all_reduce=1),
                f"ParallelMLP on {p} ranks: its {phase} made {listed or 'no communication'}; "
                f"Megatron's MLP communicates exactly once in {phase}: {WHY_ONCE[phase]}",
            )
        # An all-reduce of the right count is not enough: it must carry the rank's partial sum.
        want = partial_sums(full, x, grad, p, r)
        for phase, (event,) in phase_events(out, r).items():
            got, expected = carried(event), want[phase]
            # fc2's bias added before the reduction is a wrong output, judged by test_parallel_mlp:
            # the communication itself is right.
            biased = expected + full["b2"].double() if phase == "forward" else expected
            require(
                any(
                    got.shape == w.reshape(-1).shape
                    and torch.allclose(got, w.reshape(-1), 1e-4, 1e-5)
                    for w in (expected, biased)
                ),
                f"ParallelMLP on {p} ranks: its {phase} all-reduce carried something other than "
                f"this rank's partial {'output' if phase == 'forward' else 'input gradient'} "
                f"({WHY_ONCE[phase]}): each rank reduces the partial sum it computed from its "
                "own shards, the only thing the other ranks lack",
            )

    on_every_rank(p, check)


@pytest.mark.graded(target="tensor_parallel.{layer}", kind="correctness")
@pytest.mark.parametrize("layer", ["ColumnParallelLinear", "RowParallelLinear"])
def test_indivisible_dimension(world: World, layer: str) -> None:
    p, dim = world.size, "out_features" if layer.startswith("Column") else "in_features"
    sizes = {"in_features": 4 * p, "out_features": 4 * p, dim: 2 * p + 1}
    shape = f"{sizes['in_features']}, {sizes['out_features']}"
    for how, name in (
        ("init", f"{layer}({shape})"),
        ("from_linear", f"{layer}.from_linear(nn.Linear({shape}))"),
    ):
        out = world.call(
            scenario="tensor_parallel.construct", args=[(layer, how, sizes)] * p, case=name
        )

        def check(r: int, raised: list[str | None] = out.returned, name: str = name) -> None:
            err = raised[r]
            if err is None:
                require(
                    p == 1,
                    f"{name} on {p} ranks did not raise ValueError: {dim}={sizes[dim]} is not "
                    f"divisible by {p}, the tensor-parallel size",
                )
                return
            require(p > 1, f"{name} at world size 1 raised ValueError ({err}): 1 divides any size")
            require(
                dim in err,
                f"{name} on {p} ranks raised ValueError({err!r}): name the dimension that "
                f"{p} does not divide ({dim}={sizes[dim]})",
            )

        on_every_rank(p, check)
