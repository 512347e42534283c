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

import pytest
import torch
import torch.nn.functional as F

from grader.scenarios.tensor_parallel import linear
from grader.testkit import (
    FLOAT32_PRODUCT,
    OpName,
    TestRecord,
    World,
    check_unchanged,
    on_every_rank,
    rank_tensor,
    require,
)
from grader.testkit.compare import carried
from grader.testkit.shards import block, check_shape, check_shards, check_still_holds
from grader.testkit.tensor_parallel import (
    ALL,
    FFN,
    IN,
    OUT,
    SHAPE,
    LayerRun,
    RegionRun,
    call,
    expect,
    full_run,
    mlp_call,
    mlp_runs,
    observed,
    output_of,
    partial_sums,
    phase_events,
    phase_operations,
    raised,
    region_definition,
    shared,
    weights,
)


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
    runs = observed(out.returned, LayerRun.read, "column_forward_backward", setting)
    fix = "copy_to_parallel_region must all-reduce the input's gradient in backward"

    def check(r: int) -> None:
        seen, rows = runs[r], block(p, r, OUT)
        check_still_holds(seen.held, full, "ColumnParallelLinear", p, r)
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
        expect(seen.input_grad, run["input"], ALL, f"{what}: the input's gradient", OUT, why_grad)
        expect(seen.weight_grad, run["weight"], rows, f"{what}: weight gradient", 6)
        expect(seen.bias_grad, run["bias"], rows, f"{what}: bias gradient", 6)

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
    runs = observed(out.returned, LayerRun.read, "row_forward_backward", setting)
    w64, b64, x64 = weight.double(), bias.double(), x_full.double()

    def check(r: int) -> None:
        seen, mine = runs[r], cols[r]
        check_still_holds(seen.held, full, "RowParallelLinear", p, r)
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
        expect(seen.input_grad, run["input"], index, f"{what}: the input's gradient", OUT, why)
        expect(seen.weight_grad, run["weight"], (ALL, mine), f"{what}: weight gradient", 6)
        expect(seen.bias_grad, run["bias"], ALL, f"{what}: bias gradient", 6)

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
    runs = observed(out.returned, RegionRun.read, "region_forward_backward", function)

    def check(r: int) -> None:
        seen = runs[r]
        check_unchanged(out.args[r][1], xs[r], f"{what}: its input x")
        y_want, y_why, g_want, g_why = region_definition(function, xs, grads, r, n)
        check_shape(output_of(seen, what), tuple(y_want[0].shape), what, SHAPES[function](p, n))
        expect(output_of(seen, what), y_want, ALL, f"{what}, forward: output", p, y_why)
        got = seen.input_grad
        expect(got, g_want, ALL, f"{what}, backward: the input's gradient", p, g_why)

    on_every_rank(p, check)


@pytest.mark.graded(target="tensor_parallel.ParallelMLP", kind="correctness")
def test_parallel_mlp(world: World) -> None:
    p, what = world.size, f"ParallelMLP on {world.size} ranks"
    full, x32, grad32, out = mlp_call(world)
    runs = mlp_runs(out)
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
        seen, rows = runs[r], block(p, r, FFN)
        for found, cls, role in ((seen.has_column, "Column", "fc1"), (seen.has_row, "Row", "fc2")):
            kind = f"{cls}ParallelLinear (its {role}, {cls.lower()} parallel)"
            require(found, f"ParallelMLP.from_linears: the MLP holds no {kind}")
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
        expect(seen.input_grad, pair, ALL, f"{what}: the input's gradient", terms, why)
        for name, (want, mag), split in layers:
            index = {"rows": rows, "cols": (ALL, rows), "all": ALL}[split]
            pair, why = (want.float(), mag), {twice: p * want}
            expect(seen.grads[name], pair, index, f"{what}: {name} gradient", terms, why)

    on_every_rank(p, check)


WHY_ONCE = {
    "forward": "one all-reduce of fc2's partial outputs (fc1's output stays sharded, GELU needs "
    "no communication)",
    "backward": "one all-reduce of the input's gradient (copy_to_parallel_region before fc1)",
}


@pytest.mark.graded(target="tensor_parallel.ParallelMLP", kind="communication")
def test_parallel_mlp_communication(world: World, record: TestRecord) -> None:
    p = world.size
    full, x, grad, out = mlp_call(world)
    record.details["all_reduces"] = [
        len(out.traffic.world_collectives(r, OpName.ALL_REDUCE)) for r in range(p)
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
                    got.shape == w.reshape(-1).shape and FLOAT32_PRODUCT.holds(got, w.reshape(-1))
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

        errors = observed(out.returned, raised, "construct", name)

        def check(r: int, errors: list[str | None] = errors, name: str = name) -> None:
            err = errors[r]
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
