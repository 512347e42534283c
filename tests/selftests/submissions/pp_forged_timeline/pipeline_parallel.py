"""1F1B that runs GPipe and then rewrites any timeline the stage it was given keeps.

Earlier graders wrapped the stage in a recorder, in the rank's own process, and judged its
timeline: after the GPipe step this overwrites the recorded order with the one 1F1B
prescribes for this stage, so the timeline alone says 1F1B. Nothing the rank holds is read
now; the broker's record of the messages says GPipe: every activation went to the next
stage before the first gradient came back.
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
    if hasattr(stage, "timeline"):  # the recorder of earlier graders
        stage.timeline[:] = order + [f"B{i}" for i in range(m - warmup, m)]
    return loss
