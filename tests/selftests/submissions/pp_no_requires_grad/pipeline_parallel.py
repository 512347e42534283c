"""A received activation is used without requires_grad_(), so its .grad stays None.

Each stage but the first then has no input gradient to send back, and skips the send:
the previous stage waits for a gradient that never comes, while this one returns.
"""

from reference import pipeline_parallel as _reference
from reference.pipeline_parallel import *  # noqa: F403


class _Stage(_reference._PipelineStage):
    def recv_forward(self):
        return self._exchange(None, None, self.prev_peer)  # the bug: no .requires_grad_()

    def send_backward_recv_forward(self, input_grad):
        return self._exchange(input_grad, self.prev_peer, self.prev_peer)  # here neither

    def backward_step(self, input_tensor, output, output_grad):
        torch.autograd.backward(output, grad_tensors=output_grad)  # noqa: F405
        return None if input_tensor is None else input_tensor.grad  # None: nothing to send

    def _exchange(self, send, send_to, recv_from):
        return super()._exchange(send, None if send is None else send_to, recv_from)


_PipelineStage = _Stage  # the reference's schedules, run with this stage
