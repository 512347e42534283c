"""Rank-side scenario of the pipeline_parallel part: one training step of the student's schedule.

Rank ``r`` runs stage ``r`` of a ``p``-stage model (one ``Linear`` + ``Tanh`` per stage,
:func:`make_stage`, which the trusted side also uses for its float64 oracle), with the
weights, inputs and targets the trusted side sent. A :class:`Recorder` around the stage
notes when each microbatch's forward runs and when its output's gradient is computed:
that timeline is the rank's own observation, which the schedule tests judge beside the
broker's trusted record of the messages.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grader.judge.verdict import Cell, Pass
from grader.scenarios import mark

WIDTH = 6  # features of every activation
ROWS = 2  # rows per microbatch


def make_stage(weight: Tensor, bias: Tensor) -> nn.Sequential:
    """Stage ``Linear(WIDTH, WIDTH)`` + ``Tanh`` holding ``weight`` and ``bias``, in their dtype."""
    with torch.device("meta"):  # no random draws: the values come from the trusted side
        stage = nn.Sequential(nn.Linear(WIDTH, WIDTH, dtype=weight.dtype), nn.Tanh())
    stage[0].weight = nn.Parameter(weight.detach().clone())
    stage[0].bias = nn.Parameter(bias.detach().clone())
    return stage


class Recorder(nn.Module):
    """Records ``F{i}`` when the ``i``-th forward runs, ``B{i}`` when its output's gradient is
    (:class:`grader.judge.verdict.Cell`, written as text: what travels back is data)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.timeline: list[str] = []
        self.forwards = 0

    def forward(self, x: Tensor) -> Tensor:
        i, self.forwards = self.forwards, self.forwards + 1
        self.timeline.append(str(Cell(Pass.FORWARD, i)))
        output = self.inner(x)
        if output.requires_grad:
            output.register_hook(lambda grad: self.timeline.append(str(Cell(Pass.BACKWARD, i))))
        return output


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

    Inputs are given on stage 0 and targets on the last stage (``None`` elsewhere); they
    come back in the call's ``args``, where the test checks they were left as they were.
    Returns what the schedule returned (described, since it may be anything), every
    parameter's gradient by name, and the recorded timeline.
    """
    stage = make_stage(weight, bias)
    recorder = Recorder(stage)
    shape = (ROWS, WIDTH)
    mark("step")  # the broker's clock at the start and the end of the step: the picture's
    returned = getattr(student, function)(
        recorder, inputs, targets, F.mse_loss, num_microbatches, shape
    )
    mark("end")  # first and last idle or busy time on this stage
    is_tensor = isinstance(returned, Tensor)
    return {
        "loss_type": "None" if returned is None else type(returned).__name__,
        "loss": returned.detach().clone() if is_tensor else None,
        "loss_requires_grad": bool(is_tensor and returned.requires_grad),
        "grads": {name: param.grad for name, param in stage.named_parameters()},
        "timeline": list(recorder.timeline),
    }
