"""1F1B that runs the GPipe schedule: right gradients and loss, wrong order of work.

Every forward runs before any backward, so stage r holds all m microbatches in flight
instead of at most p - r: only the 1F1B schedule test can tell.
"""

from reference.pipeline_parallel import *  # noqa: F403
from reference.pipeline_parallel import gpipe_step


def one_f_one_b_step(
    stage, inputs, targets, loss_fn, num_microbatches, activation_shape, group=None
):
    return gpipe_step(stage, inputs, targets, loss_fn, num_microbatches, activation_shape, group)
