"""Graded tests of ``assignments/tensor_parallel.py``: Megatron-style tensor parallelism.

Every rank builds the same full ``nn.Linear`` layers from a fixed seed, shards them with the
submission's ``from_linear``/``from_linears`` and compares with the full layers run on one
process, in float32 within the rounding bound of ``grader.testkit.check_close``:

- ``column_parallel_linear``, ``row_parallel_linear``: the shard each rank holds (rows,
  resp. columns ``[r*n/p, (r+1)*n/p)`` of the weight), the output, and the gradients of
  the input, the weight and the bias, with both settings of ``gather_output``, resp.
  ``input_is_parallel``.
- ``region_function``: each of the four autograd functions, forward and backward, against
  its definition, with a different non-contiguous input and upstream gradient on every rank.
- ``parallel_mlp``: ``ParallelMLP.from_linears(fc1, fc2)`` against ``fc2(gelu(fc1(x)))``.
- ``parallel_mlp_communication`` (schedule): the communication recorded around the MLP's
  forward and around its backward is exactly one all-reduce each, and nothing else: that is
  what the column-then-row split is for.
- ``indivisible_dimension``: a split dimension that p does not divide raises ``ValueError``
  naming it (at p = 1 every size divides, and construction must simply work).

A wrong value is explained where a usual mistake accounts for it: a bias added on every
rank, a gradient that was not all-reduced, a gradient slice that was not all-gathered.
"""

from __future__ import annotations

import copy
from collections import Counter
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grader.rank.context import TestContext
from grader.testkit import check_close, check_unchanged, rank_tensor

IN, OUT, FFN = 8, 12, 16  # divisible by 1, 2 and 4
SHAPE = (2, 3)  # leading dimensions of every activation: 6 rows
ALL = slice(None)
Pair = tuple[Tensor, Tensor]  # an expected value and the magnitude its rounding scales with
Why = dict[str, Tensor]  # what a tensor would hold after each usual mistake, by its hint


def full_linear(seed: int, n_in: int, n_out: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out)


def shared(key: str, features: int) -> Tensor:
    """The same activation (or upstream gradient) on every rank."""
    return rank_tensor(key, 0, (*SHAPE, features), torch.float32)


def block(p: int, rank: int, n: int) -> slice:
    return slice(rank * n // p, (rank + 1) * n // p)


def check_shard(layer: nn.Module, full: nn.Linear, rows: slice, cols: slice, what: str) -> None:
    """The contract's shard: ``weight[rows, cols]``, and the bias's ``rows`` (all if replicated)."""
    shard = {"weight": full.weight.detach()[rows, cols], "bias": full.bias.detach()[rows]}
    for name, want in shard.items():
        got = getattr(layer, name, None)
        assert isinstance(got, Tensor), f"{what}: the layer has no .{name} tensor"
        full_shape = getattr(full, name).shape
        whole = " (the full tensor, not this rank's shard)" if got.shape == full_shape else ""
        assert got.shape == want.shape, (
            f"{what}: .{name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}{whole}"
        )
        part = "columns" if name == "weight" and cols != ALL else "rows"
        holds = f"{part} [r*n/p, (r+1)*n/p) of it"
        assert torch.equal(got.detach(), want), (
            f"{what}: .{name} is not this rank's shard of the full layer's {name}: rank r "
            f"holds {'the full bias' if name == 'bias' and rows == ALL else holds}"
        )


def full_run(full: nn.Linear, x: Tensor, grad: Tensor) -> dict[str, Pair]:
    """The full layer's output and gradients, each with the magnitude its rounding scales with."""
    layer, x = copy.deepcopy(full), x.clone().requires_grad_()
    y = layer(x)
    y.backward(grad)
    w, g2, x2 = layer.weight.detach().abs(), grad.abs().reshape(-1, grad.shape[-1]), x.detach()
    return {
        "output": (y.detach(), x2.abs() @ w.T + layer.bias.detach().abs()),
        "input": (x.grad, grad.abs() @ w),
        "weight": (layer.weight.grad, g2.T @ x2.abs().reshape(-1, x2.shape[-1])),
        "bias": (layer.bias.grad, g2.sum(0)),
    }


def expect(
    got: Tensor | None, pair: Pair, index: Any, what: str, terms: int, why: Why | None = None
) -> None:
    """``got`` equals ``pair[0][index]`` within the rounding bound of magnitude ``pair[1]``."""
    assert got is not None, f"{what} is missing (.grad is None)"
    explanations = {reason: value[index] for reason, value in (why or {}).items()}
    want, magnitude = pair[0][index], pair[1][index]
    check_close(got, want, what, magnitude=magnitude, terms=terms, explanations=explanations)


def shard_of(student: ModuleType, layer: str, full: nn.Linear, what: str, **flag: bool) -> Any:
    """``layer.from_linear(full, **flag)``, which must leave ``full`` as it was."""
    before = full.weight.detach().clone()
    sharded = getattr(student, layer).from_linear(full, **flag)
    check_unchanged(full.weight, before, f"{what}: from_linear's argument linear.weight")
    return sharded


@pytest.mark.graded(target="tensor_parallel.ColumnParallelLinear", kind="correctness")
@pytest.mark.parametrize("gather", [False, True], ids=["gather_output=False", "gather_output=True"])
def test_column_parallel_linear(
    student: ModuleType, rank: int, world_size: int, gather: bool
) -> None:
    p, rows = world_size, block(world_size, rank, OUT)
    what = f"ColumnParallelLinear(gather_output={gather}) on {p} ranks"
    full = full_linear(11, IN, OUT)
    layer = shard_of(student, "ColumnParallelLinear", full, what, gather_output=gather)
    check_shard(layer, full, rows, ALL, what)
    x, grad = shared("col/x", IN), shared("col/grad", OUT)
    run, out = full_run(full, x, grad), (..., ALL if gather else rows)
    y = layer(x := x.clone().requires_grad_())
    expect(y, run["output"], out, f"{what}: output", IN + 1)
    y.backward(grad[out])
    fix = "copy_to_parallel_region must all-reduce the input's gradient in backward"
    why = {
        f"this rank's partial sum only: {fix}": grad[..., rows] @ full.weight.detach()[rows],
        f"{p}x the expected: {fix} once": p * run["input"][0],
    }
    expect(x.grad, run["input"], ALL, f"{what}: the input's gradient", OUT, why)
    expect(layer.weight.grad, run["weight"], rows, f"{what}: weight gradient", 6)
    expect(layer.bias.grad, run["bias"], rows, f"{what}: bias gradient", 6)


@pytest.mark.graded(target="tensor_parallel.RowParallelLinear", kind="correctness")
@pytest.mark.parametrize(
    "parallel", [True, False], ids=["input_is_parallel=True", "input_is_parallel=False"]
)
def test_row_parallel_linear(
    student: ModuleType, rank: int, world_size: int, parallel: bool
) -> None:
    p, cols = world_size, block(world_size, rank, IN)
    what = f"RowParallelLinear(input_is_parallel={parallel}) on {p} ranks"
    full = full_linear(12, IN, OUT)
    layer = shard_of(student, "RowParallelLinear", full, what, input_is_parallel=parallel)
    check_shard(layer, full, ALL, cols, what)
    x_full, grad = shared("row/x", IN), shared("row/grad", OUT)
    run, weight, bias = full_run(full, x_full, grad), full.weight.detach(), full.bias.detach()
    y = layer(x := (x_full[..., cols] if parallel else x_full).clone().requires_grad_())
    why = {
        "the bias is added on every rank before the reduction: the output is off by (p-1) x "
        f"bias = {p - 1} x bias; add it once, after the all-reduce": run["output"][0]
        + (p - 1) * bias,
        "this rank's partial product only: reduce_from_parallel_region must all-reduce the "
        "partial products in forward": x_full[..., cols] @ weight[:, cols].T + bias,
    }
    expect(y, run["output"], ALL, f"{what}: output", IN + 1, why)
    y.backward(grad)
    only_mine = torch.zeros_like(x_full)
    only_mine[..., cols] = run["input"][0][..., cols]
    why = {
        "only this rank's slice, zeros elsewhere: scatter_to_parallel_region must all-gather "
        "the gradient in backward": only_mine,
        f"{p}x the expected: reduce_from_parallel_region's backward must be the identity": p
        * run["input"][0],
    }
    index = (..., cols if parallel else ALL)
    expect(x.grad, run["input"], index, f"{what}: the input's gradient", OUT, why)
    expect(layer.weight.grad, run["weight"], (ALL, cols), f"{what}: weight gradient", 6)
    expect(layer.bias.grad, run["bias"], ALL, f"{what}: bias gradient", 6)


FUNCTIONS = [f"{verb}_parallel_region" for verb in ("copy_to", "reduce_from", "gather_from")]
FUNCTIONS.append("scatter_to_parallel_region")


def region_definition(
    function: str, xs: list[Tensor], grads: list[Tensor], rank: int, n: int
) -> tuple[Pair, Why, Pair, Why]:
    """Output and input gradient by the definition (with magnitudes), and the usual mistakes."""
    mine = slice(rank * n, (rank + 1) * n)
    x_sum, x_mag = sum(xs), sum(t.abs() for t in xs)
    g_sum, g_mag = sum(grads), sum(t.abs() for t in grads)
    x, g = xs[rank], grads[rank]
    if function == "copy_to_parallel_region":
        y_why = {"it is the sum over ranks: the forward is the identity": x_sum}
        g_why = {"it is this rank's own gradient: the backward all-reduces it": g}
        return (x, x.abs()), y_why, (g_sum, g_mag), g_why
    if function == "reduce_from_parallel_region":
        y_why = {"it is this rank's input: the forward all-reduces it": x}
        g_why = {"it is the sum over ranks: the backward is the identity": g_sum}
        return (x_sum, x_mag), y_why, (g, g.abs()), g_why
    if function == "gather_from_parallel_region":
        y = torch.cat(xs, -1)
        return (y, y.abs()), {}, (g[:, mine], g[:, mine].abs()), {}
    spread = torch.zeros(2, n * len(xs))
    spread[:, mine] = g
    g_all = torch.cat(grads, -1)
    g_why = {"only this rank's slice, zeros elsewhere: the backward all-gathers": spread}
    return (x[:, mine], x[:, mine].abs()), {}, (g_all, g_all.abs()), g_why


@pytest.mark.graded(target="tensor_parallel.{function}", kind="correctness")
@pytest.mark.parametrize("function", FUNCTIONS)
def test_region_function(student: ModuleType, rank: int, world_size: int, function: str) -> None:
    p, n, what = world_size, 3, f"{function} on {world_size} ranks"
    width = n * p if function.startswith("scatter") else n
    xs = [rank_tensor(function, r, (2, width), torch.float32, contiguous=False) for r in range(p)]
    x = rank_tensor(function, rank, (2, width), torch.float32, contiguous=False)
    x.requires_grad_()  # a leaf equal to xs[rank], every other element of its storage
    y = getattr(student, function)(x)
    check_unchanged(x, xs[rank], f"{what}: its input x")
    shape = (2, n * p) if function.startswith("gather") else (2, n)
    grads = [rank_tensor(function + "/grad", r, shape, torch.float32) for r in range(p)]
    y_want, y_why, g_want, g_why = region_definition(function, xs, grads, rank, n)
    expect(y, y_want, ALL, f"{what}, forward: output", p, y_why)
    y.backward(grads[rank])
    expect(x.grad, g_want, ALL, f"{what}, backward: the input's gradient", p, g_why)


def mlp_case(student: ModuleType) -> tuple[nn.Linear, nn.Linear, nn.Module, Tensor, Tensor]:
    fc1, fc2 = full_linear(21, IN, FFN), full_linear(22, FFN, IN)
    mlp = student.ParallelMLP.from_linears(fc1, fc2)
    return fc1, fc2, mlp, shared("mlp/x", IN), shared("mlp/grad", IN)


def find_layer(mlp: nn.Module, cls: type, role: str) -> nn.Module:
    found = [m for m in mlp.modules() if isinstance(m, cls)]
    assert found, f"ParallelMLP.from_linears: the MLP holds no {cls.__name__} (its {role})"
    return found[0]


@pytest.mark.graded(target="tensor_parallel.ParallelMLP", kind="correctness")
def test_parallel_mlp(student: ModuleType, rank: int, world_size: int) -> None:
    p, rows, what = world_size, block(world_size, rank, FFN), f"ParallelMLP on {world_size} ranks"
    fc1, fc2, mlp, x, grad = mlp_case(student)
    column = find_layer(mlp, student.ColumnParallelLinear, "fc1, column parallel")
    row = find_layer(mlp, student.RowParallelLinear, "fc2, row parallel")
    a, b, x_ref = copy.deepcopy(fc1), copy.deepcopy(fc2), x.clone().requires_grad_()
    y_want = b(F.gelu(a(x_ref)))
    y_want.backward(grad)
    x_mine = x.clone().requires_grad_()  # what this rank's shards alone give the input
    w1, b1, w2 = fc1.weight.detach(), fc1.bias.detach(), fc2.weight.detach()
    mine = F.linear(F.gelu(F.linear(x_mine, w1[rows], b1[rows])), w2[:, rows])
    (partial,) = torch.autograd.grad(mine, x_mine, grad)
    # Rounding bounds: |GELU'| <= 1.13, so 1.2 x the magnitude of fc1's output covers GELU's.
    m_h = 1.2 * (x.abs() @ w1.abs().T + b1.abs())
    m_gh = 1.2 * (grad.abs() @ w2.abs())
    g_rows, gh_rows = grad.abs().reshape(-1, IN), m_gh.reshape(-1, FFN)
    y = mlp(x_in := x.clone().requires_grad_())
    explanations = {
        f"fc2's bias is added on every rank before the reduction: the output is off by (p-1) x "
        f"bias = {p - 1} x bias": y_want.detach() + (p - 1) * fc2.bias.detach(),
        "GELU used the tanh approximation, use the exact one (nn.GELU())": b(
            F.gelu(a(x), approximate="tanh")
        ).detach(),
    }
    magnitude, terms = m_h @ w2.abs().T + fc2.bias.detach().abs(), IN + FFN + 8
    expect(y, (y_want.detach(), magnitude), ALL, f"{what}: output", terms, explanations)
    y.backward(grad)
    twice = f"{p}x the expected: an all-reduce too many in backward"
    why = {twice: p * x_ref.grad, "this rank's partial sum only: it must be all-reduced": partial}
    expect(
        x_in.grad, (x_ref.grad, m_gh @ w1.abs()), ALL, f"{what}: the input's gradient", terms, why
    )
    for name, layer, pair, index in (
        ("fc1 weight", column.weight, (a.weight.grad, gh_rows.T @ x.abs().reshape(-1, IN)), rows),
        ("fc1 bias", column.bias, (a.bias.grad, gh_rows.sum(0)), rows),
        ("fc2 weight", row.weight, (b.weight.grad, g_rows.T @ m_h.reshape(-1, FFN)), (ALL, rows)),
        ("fc2 bias", row.bias, (b.bias.grad, g_rows.sum(0)), ALL),
    ):
        why = {twice: p * pair[0]}
        expect(layer.grad, pair, index, f"{what}: {name} gradient", terms, why)


@pytest.mark.graded(target="tensor_parallel.ParallelMLP", kind="communication")
def test_parallel_mlp_communication(ctx: TestContext, student: ModuleType, world_size: int) -> None:
    _, _, mlp, x, grad = mlp_case(student)
    x.requires_grad_()
    with ctx.recording() as forward:
        y = mlp(x)
    with ctx.recording() as backward:
        y.backward(grad)
    why = {
        "forward": "one all-reduce of fc2's partial outputs (fc1's output stays sharded, GELU "
        "needs no communication)",
        "backward": "one all-reduce of the input's gradient (copy_to_parallel_region before fc1)",
    }
    calls = {}
    for phase, log in (("forward", forward), ("backward", backward)):
        calls[phase] = Counter(e.op.replace("allreduce", "all_reduce") for e in log.events)
        ctx.extra[f"{phase}_calls"] = dict(calls[phase])
    for phase, made in calls.items():
        listed = ", ".join(f"{op} x{n}" for op, n in sorted(made.items())) or "no communication"
        assert made == Counter(all_reduce=1), (
            f"ParallelMLP on {world_size} ranks: its {phase} made {listed}; Megatron's MLP "
            f"communicates exactly once in {phase}: {why[phase]}"
        )


@pytest.mark.graded(target="tensor_parallel.{layer}", kind="correctness")
@pytest.mark.parametrize("layer", ["ColumnParallelLinear", "RowParallelLinear"])
def test_indivisible_dimension(student: ModuleType, world_size: int, layer: str) -> None:
    p, dim = world_size, "out_features" if layer.startswith("Column") else "in_features"
    sizes = {"in_features": 4 * p, "out_features": 4 * p, dim: 2 * p + 1}
    cls, shape = getattr(student, layer), f"{sizes['in_features']}, {sizes['out_features']}"
    for name, make in (
        (f"{layer}({shape})", lambda: cls(**sizes)),
        (f"{layer}.from_linear(nn.Linear({shape}))", lambda: cls.from_linear(nn.Linear(**sizes))),
    ):
        try:
            make()
        except ValueError as err:
            assert p > 1, f"{name} at world size 1 raised ValueError ({err}): 1 divides any size"
            assert dim in str(err), (
                f"{name} on {p} ranks raised ValueError({str(err)!r}): name the dimension that "
                f"{p} does not divide ({dim}={sizes[dim]})"
            )
            continue
        assert p == 1, (
            f"{name} on {p} ranks did not raise ValueError: {dim}={sizes[dim]} is not divisible "
            f"by {p}, the tensor-parallel size"
        )
