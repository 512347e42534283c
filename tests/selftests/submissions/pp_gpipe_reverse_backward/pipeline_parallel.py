"""GPipe backpropagates its microbatches in reverse order (last forwarded, first backwarded).

The gradients are right (the order does not change a sum), but the docstring asks for
forward order, microbatch 0 first, as torch.distributed.pipelining's ScheduleGPipe runs.
"""

from collections import deque

from reference import pipeline_parallel as _reference
from reference.pipeline_parallel import *  # noqa: F403


def gpipe_step(stage, inputs, targets, loss_fn, num_microbatches, activation_shape, group=None):
    pipe = _reference._PipelineStage(
        stage, inputs, targets, loss_fn, num_microbatches, activation_shape, group
    )
    saved = deque()
    for microbatch in range(num_microbatches):
        input_tensor = pipe.recv_forward()
        output = pipe.forward_step(microbatch, input_tensor)
        pipe.send_forward(output)
        saved.append((input_tensor, output))
    while saved:
        input_tensor, output = saved.pop()  # the bug: popleft, microbatch 0 first
        pipe.send_backward(pipe.backward_step(input_tensor, output, pipe.recv_backward()))
    return pipe.mean_loss()
