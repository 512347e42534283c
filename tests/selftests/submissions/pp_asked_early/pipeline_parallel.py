"""An attack on the order of the waits: each schedule runs the other one, and every stage
posts the receive of every activation and every gradient at its start and asks for each at
once (``is_completed()``), so that the broker's waits say every message was wanted before
any was sent. A recorder's timeline, where the stage has one, is rewritten to the order of
the schedule asked for. The gradients stay right. But a message reaches a rank only once it
was sent: GPipe's gradient 0 still leaves before the last activation could have come, and
1F1B's activations still leave before the gradients that should come first.
"""

import types
from collections import deque

import torch
import torch.distributed as dist

from reference import pipeline_parallel as _reference
from reference.pipeline_parallel import *  # noqa: F403


class _Stage(_reference._PipelineStage):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        peers = (p for p in (self.prev_peer, self.next_peer) if p is not None)
        self.posted = {peer: deque(self._post(peer)) for peer in peers}

    def _post(self, peer):
        for _ in range(self.num_microbatches):
            buffer = torch.empty(self.activation_shape, dtype=_reference.ACTIVATION_DTYPE)
            work = dist.irecv(buffer, peer, group=self.group)
            work.is_completed()  # asked for at once: the broker records a wait here
            yield buffer, work

    def _exchange(self, send, send_to, recv_from):
        sending = None
        if send_to is not None:
            sending = dist.isend(send.detach().contiguous(), send_to, group=self.group)
        received = None
        if recv_from is not None:
            received, work = self.posted[recv_from].popleft()
            work.wait()
        if sending is not None:
            sending.wait()
        return received


def _with_this_stage(schedule):
    """The reference's schedule, building this file's stage instead of the reference's."""
    namespace = {**vars(_reference), "_PipelineStage": _Stage}
    return types.FunctionType(
        schedule.__code__, namespace, schedule.__name__, schedule.__defaults__
    )


def _forge(stage, order):
    if hasattr(stage, "timeline"):  # the recorder of earlier graders
        stage.timeline[:] = order


def gpipe_step(stage, inputs, targets, loss_fn, num_microbatches, activation_shape, group=None):
    run = _with_this_stage(_reference.one_f_one_b_step)  # the attack: 1F1B
    loss = run(stage, inputs, targets, loss_fn, num_microbatches, activation_shape, group)
    m = num_microbatches
    _forge(stage, [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)])
    return loss


def one_f_one_b_step(
    stage, inputs, targets, loss_fn, num_microbatches, activation_shape, group=None
):
    run = _with_this_stage(_reference.gpipe_step)  # the attack: GPipe
    loss = run(stage, inputs, targets, loss_fn, num_microbatches, activation_shape, group)
    p, rank, m = dist.get_world_size(group), dist.get_rank(group), num_microbatches
    warmup = min(p - rank - 1, m)
    order = [f"F{i}" for i in range(warmup)]
    for i in range(m - warmup):
        order += [f"F{warmup + i}", f"B{i}"]
    _forge(stage, order + [f"B{i}" for i in range(m - warmup, m)])
    return loss
