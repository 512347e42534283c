"""Rank-side scenarios of the tensor_parallel part: shard full layers, run them, report back.

The trusted side makes every weight, input and upstream gradient and sends each rank
what it needs; a scenario builds the full ``nn.Linear`` layers from them, lets the
submission shard them, runs one forward and one backward, and returns what it saw (the
shard, the output, the gradients). It holds no expected value: the graded test compares
what comes back with the full layers run in float64 on the trusted side.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn

from grader.scenarios import gate


def linear(weight: Tensor, bias: Tensor) -> nn.Linear:
    """The full ``nn.Linear`` of ``weight`` and ``bias``, in their dtype: both sides build it."""
    out_features, in_features = weight.shape
    with torch.device("meta"):  # no random draws: the values come from the trusted side
        layer = nn.Linear(in_features, out_features, dtype=weight.dtype)
    layer.weight = nn.Parameter(weight.detach().clone())
    layer.bias = nn.Parameter(bias.detach().clone())
    return layer


def _tensor(value: object) -> Tensor | None:
    return value.detach().clone() if isinstance(value, Tensor) else None


def _grad(module: nn.Module | None, name: str) -> Tensor | None:
    value = getattr(module, name, None)
    return value.grad if isinstance(value, Tensor) else None


def _shard(layer: nn.Module, full: nn.Linear) -> dict[str, Any]:
    return {
        "linear_weight": full.weight.detach().clone(),  # from_linear must leave it as it was
        "weight": _tensor(getattr(layer, "weight", None)),
        "bias": _tensor(getattr(layer, "bias", None)),
    }


def shard(
    student: ModuleType, layer: str, weight: Tensor, bias: Tensor, setting: dict[str, bool]
) -> dict[str, Any]:
    """``layer.from_linear(full, **setting)`` alone, and the dtypes of a float64 layer's shard.

    Run before any forward, so that a wrong shard is named before it breaks a matmul.
    """
    cls = getattr(student, layer)
    full = linear(weight, bias)
    seen = _shard(cls.from_linear(full, **setting), full)
    seen["float64_dtypes"] = _dtypes(
        cls.from_linear(linear(weight.double(), bias.double()), **setting)
    )
    return seen


def _run_layer(layer: nn.Module, full: nn.Linear, x: Tensor, grad: Tensor) -> dict:
    """The shard as built, then one forward and backward of the layer on ``x``.

    The backward runs only if the output has the upstream gradient's shape (the shape it
    must have): otherwise the test names the output's shape, not autograd's mismatch.
    """
    seen = _shard(layer, full)
    y = layer(x.requires_grad_())
    seen["output_type"] = type(y).__name__
    seen["output"] = y if isinstance(y, Tensor) else None
    if isinstance(y, Tensor) and y.shape == grad.shape:
        y.backward(grad)
    seen["input_grad"] = x.grad
    seen["weight_grad"] = _grad(layer, "weight")
    seen["bias_grad"] = _grad(layer, "bias")
    return seen


def column_forward_backward(
    student: ModuleType, weight: Tensor, bias: Tensor, x: Tensor, grad: Tensor, gather: bool
) -> dict:
    """``ColumnParallelLinear.from_linear(full, gather_output=gather)``, run on ``x``."""
    full = linear(weight, bias)
    layer = student.ColumnParallelLinear.from_linear(full, gather_output=gather)
    return _run_layer(layer, full, x, grad)


def row_forward_backward(
    student: ModuleType, weight: Tensor, bias: Tensor, x: Tensor, grad: Tensor, parallel: bool
) -> dict:
    """``RowParallelLinear.from_linear(full, input_is_parallel=parallel)``, run on ``x``."""
    full = linear(weight, bias)
    layer = student.RowParallelLinear.from_linear(full, input_is_parallel=parallel)
    return _run_layer(layer, full, x, grad)


def region_forward_backward(student: ModuleType, function: str, x: Tensor, grad: Tensor) -> dict:
    """One of the four autograd functions on the (non-contiguous) leaf ``x``, then backward.

    ``x`` comes back in the call's ``args``: the function must leave it as it was.
    """
    y = getattr(student, function)(x.requires_grad_())
    seen: dict[str, Any] = {"output_type": type(y).__name__, "output": None}
    if isinstance(y, Tensor):
        seen["output"] = y.detach().clone()  # before backward: nothing may change it later
        if y.shape == grad.shape:  # else the test names the output's shape
            y.backward(grad)
    seen["input_grad"] = x.grad
    return seen


def _find(mlp: nn.Module, cls: type) -> nn.Module | None:
    return next((m for m in mlp.modules() if isinstance(m, cls)), None)


def _dtypes(layer: nn.Module | None) -> list[str]:
    tensors = (getattr(layer, "weight", None), getattr(layer, "bias", None))
    return [str(t.dtype) if isinstance(t, Tensor) else "none" for t in tensors]


def mlp_shards(
    student: ModuleType, fc1: tuple[Tensor, Tensor], fc2: tuple[Tensor, Tensor]
) -> dict[str, Any]:
    """``ParallelMLP.from_linears(fc1, fc2)`` alone: its two layers' shards, before a forward."""
    full = linear(*fc1), linear(*fc2)
    mlp = student.ParallelMLP.from_linears(*full)
    wide = student.ParallelMLP.from_linears(
        *(linear(w.double(), b.double()) for w, b in (fc1, fc2))
    )
    seen: dict[str, Any] = {}
    for name, cls, layer in (
        ("fc1", "ColumnParallelLinear", full[0]),
        ("fc2", "RowParallelLinear", full[1]),
    ):
        found = _find(mlp, getattr(student, cls))
        seen[name] = None if found is None else _shard(found, layer)
        if found is not None:
            seen[name]["float64_dtypes"] = _dtypes(_find(wide, getattr(student, cls)))
    return seen


def mlp_forward_backward(
    student: ModuleType,
    fc1: tuple[Tensor, Tensor],
    fc2: tuple[Tensor, Tensor],
    shape: tuple[int, ...],
) -> dict:
    """``ParallelMLP.from_linears(fc1, fc2)`` run on the input (of ``shape``) that the gate
    "forward" hands over, then backward of the output's gradient that the gate "backward"
    hands over: the output and the layers' gradients.

    Nothing the forward computes can exist before the rank passed the first gate, nor
    anything the backward computes before the second: the broker's record of where the rank
    passed them splits its operations into the MLP's forward and its backward.
    """
    mlp = student.ParallelMLP.from_linears(linear(*fc1), linear(*fc2))
    column = _find(mlp, student.ColumnParallelLinear)
    row = _find(mlp, student.RowParallelLinear)
    x = gate("forward").to(fc1[0].dtype).view(shape).requires_grad_()
    y = mlp(x)
    grad = gate("backward").to(fc2[0].dtype).view(shape)
    if isinstance(y, Tensor) and y.shape == grad.shape:  # else the test names the shape
        y.backward(grad)
    return {
        "has_column": column is not None,
        "has_row": row is not None,
        "output_type": type(y).__name__,
        "output": y if isinstance(y, Tensor) else None,
        "input_grad": x.grad,
        "fc1 weight": _grad(column, "weight"),
        "fc1 bias": _grad(column, "bias"),
        "fc2 weight": _grad(row, "weight"),
        "fc2 bias": _grad(row, "bias"),
    }


def construct(student: ModuleType, layer: str, how: str, sizes: dict[str, int]) -> str | None:
    """Build ``layer`` with ``sizes`` directly (``how="init"``) or ``from_linear``.

    Returns the ``ValueError``'s message if it raised one, ``None`` if it did not; any
    other exception is the submission's failure.
    """
    cls = getattr(student, layer)
    try:
        if how == "init":
            cls(**sizes)
        else:
            cls.from_linear(nn.Linear(**sizes))
    except ValueError as err:
        return str(err)
    return None
