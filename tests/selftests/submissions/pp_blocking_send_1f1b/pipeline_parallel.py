"""1F1B with blocking sends: in the steady state stage r sends an activation to r + 1 while
r + 1 sends a gradient to r; a blocking gloo send waits for its receive, so both wait forever.

GPipe (the reference's) never sends both ways at once and is unaffected.
"""

import types

import torch
import torch.distributed as dist

from reference import pipeline_parallel as _reference
from reference.pipeline_parallel import *  # noqa: F403


class _Stage(_reference._PipelineStage):
    def _exchange(self, send, send_to, recv_from):
        if send_to is not None:
            dist.send(send.detach().contiguous(), send_to, group=self.group)  # the bug
        received = None
        if recv_from is not None:
            received = torch.empty(self.activation_shape, dtype=_reference.ACTIVATION_DTYPE)
            dist.recv(received, recv_from, group=self.group)
        return received


def _with_this_stage(schedule):
    """The reference's schedule, building this file's stage instead of the reference's."""
    namespace = {**vars(_reference), "_PipelineStage": _Stage}
    return types.FunctionType(
        schedule.__code__, namespace, schedule.__name__, schedule.__defaults__
    )


one_f_one_b_step = _with_this_stage(_reference.one_f_one_b_step)
