"""Rank-side scenario of the pipeline_parallel part: one training step of the student's schedule.

Rank ``r`` runs stage ``r`` of a ``p``-stage model (one ``Linear`` + ``Tanh`` per stage,
:func:`make_stage`, which the trusted side also uses for its float64 oracle), with the
weights and targets the trusted side sent. Stage 0's ``inputs`` is a stand-in of the batch's
shape (:func:`stand_in`): the rows of microbatch ``j`` come only through the test's gate
"microbatch j", which :class:`FirstStage` passes when the schedule first runs that
microbatch forward, so the broker's record says from where stage 0 could have run it. The
scenario records nothing of the order of work: the schedule tests read it from the broker.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grader.scenarios import gate, mark

WIDTH = 6  # features of every activation
ROWS = 2  # rows per microbatch


def make_stage(weight: Tensor, bias: Tensor) -> nn.Sequential:
    """Stage ``Linear(WIDTH, WIDTH)`` + ``Tanh`` holding ``weight`` and ``bias``, in their dtype."""
    with torch.device("meta"):  # no random draws: the values come from the trusted side
        stage = nn.Sequential(nn.Linear(WIDTH, WIDTH, dtype=weight.dtype), nn.Tanh())
    stage[0].weight = nn.Parameter(weight.detach().clone())
    stage[0].bias = nn.Parameter(bias.detach().clone())
    return stage


def stand_in(num_microbatches: int) -> Tensor:
    """Stage 0's ``inputs``: every value of microbatch ``j``'s rows is ``j`` (float32)."""
    labels = torch.arange(num_microbatches, dtype=torch.float32).repeat_interleave(ROWS)
    return labels[:, None].expand(num_microbatches * ROWS, WIDTH).contiguous()


class FirstStage(nn.Module):
    """Stage 0 as the schedule gets it: run on microbatch ``j``'s rows of the stand-in, it
    runs the stage on microbatch ``j``'s real rows, taken at the gate "microbatch j" (the
    gates in order, each once, the first time a microbatch up to ``j`` is run)."""

    def __init__(self, inner: nn.Module, num_microbatches: int) -> None:
        super().__init__()
        self.inner = inner
        self.num_microbatches = num_microbatches
        self.rows: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        j = self.microbatch(x)
        while len(self.rows) <= j:
            self.rows.append(gate(f"microbatch {len(self.rows)}").view(ROWS, WIDTH))
        return self.inner(self.rows[j].to(device=x.device, dtype=x.dtype))

    def microbatch(self, x: Tensor) -> int:
        """Which microbatch of the stand-in ``x`` is; ValueError if it is none."""
        values = x.detach().unique() if tuple(x.shape) == (ROWS, WIDTH) else x.new_empty(0)
        j = int(values[0]) if values.numel() == 1 else -1
        if not (0 <= j < self.num_microbatches and float(values[0]) == j):
            raise ValueError(
                f"the first stage takes one microbatch of `inputs` at a time, {ROWS} rows of "
                f"{WIDTH} (tensor_split of inputs into num_microbatches chunks); it was given "
                f"{tuple(x.shape)}"
            )
        return j


def step(
    student: ModuleType,
    function: str,
    weight: Tensor,
    bias: Tensor,
    inputs: Tensor | None,
    targets: Tensor | None,
    num_microbatches: int,
) -> dict[str, Any]:
    """Call ``student.<function>`` on this rank's stage as the contract says.

    The stand-in inputs are given on stage 0 and targets on the last stage (``None``
    elsewhere); they come back in the call's ``args``, where the test checks they were left
    as they were. Returns what the schedule returned (described, since it may be anything)
    and every parameter's gradient by name.
    """
    stage = make_stage(weight, bias)
    given = stage if inputs is None else FirstStage(stage, num_microbatches)
    shape = (ROWS, WIDTH)
    mark("step")  # the broker's clock at the start and the end of the step: the picture's
    returned = getattr(student, function)(
        given, inputs, targets, F.mse_loss, num_microbatches, shape
    )
    mark("end")  # first and last idle or busy time on this stage
    is_tensor = isinstance(returned, Tensor)
    return {
        "loss_type": "None" if returned is None else type(returned).__name__,
        "loss": returned.detach().clone() if is_tensor else None,
        "loss_requires_grad": bool(is_tensor and returned.requires_grad),
        "grads": {name: param.grad for name, param in stage.named_parameters()},
    }
