"""GPipe's last stage backpropagates each microbatch as soon as its forward is done.

It sends microbatch 0's gradient back while the previous stage still sends it
activations; with blocking sends both wait for the other's receive: a deadlock, from
2 microbatches on. (With one microbatch the order is GPipe's.)
"""

from reference import pipeline_parallel as _reference
from reference.pipeline_parallel import *  # noqa: F403


def gpipe_step(stage, inputs, targets, loss_fn, num_microbatches, activation_shape, group=None):
    pipe = _reference._PipelineStage(
        stage, inputs, targets, loss_fn, num_microbatches, activation_shape, group
    )
    if not pipe.is_last:
        return _reference.gpipe_step(
            stage, inputs, targets, loss_fn, num_microbatches, activation_shape, group
        )
    for microbatch in range(num_microbatches):  # the bug: a backward before every forward
        input_tensor = pipe.recv_forward()
        output = pipe.forward_step(microbatch, input_tensor)
        pipe.send_backward(pipe.backward_step(input_tensor, output, None))
    return pipe.mean_loss()
