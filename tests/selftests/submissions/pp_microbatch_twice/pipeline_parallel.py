"""The last stage backpropagates microbatch 0 twice (a first backward kept from a warm-up).

Its input's gradient is then twice microbatch 0's, and so is every stage's share of it:
the gradients hold microbatch 0's share twice. The loss returned and the order are right.
"""

from reference import pipeline_parallel as _reference
from reference.pipeline_parallel import *  # noqa: F403


class _Stage(_reference._PipelineStage):
    def backward_step(self, input_tensor, output, output_grad):
        if self.is_last and len(self.losses) > 0 and not getattr(self, "_twice", False):
            self._twice = True  # the bug: one more backward of the first microbatch
            torch.autograd.backward(output, retain_graph=True)  # noqa: F405
        return super().backward_step(input_tensor, output, output_grad)


_PipelineStage = _Stage  # the reference's schedules, run with this stage
