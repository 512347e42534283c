"""Assignment: pipeline parallelism with GPipe and 1F1B schedules.

A model is cut into p consecutive stages; stage i lives on rank i of `group`
(`dist.get_rank(group)`, `dist.get_world_size(group)`). One training step splits the batch
into m equal microbatches along dim 0 and streams them through the stages. At each boundary
between stages, each microbatch's activation goes forward and its gradient comes back, both
float32 tensors of `activation_shape`; with one stage (p == 1) there are no messages at all.
GPipe runs all forwards, then all backwards, in microbatch order. 1F1B runs
`min(p - r - 1, m)` warm-up forwards on stage r, then alternates one forward and one
backward, then drains the backwards. You may use anything in `torch.distributed`.

Graded (`grader list pipeline_parallel`; points in tests/graded/grading.yaml), at
p = 2, 3, 4 stages with fewer microbatches than stages, as many, and `2p + 1`: the loss
(on the last stage) and every gradient must equal those of the mean loss over the whole
batch, in float64. The `*_schedule` tests identify each message by what it carries and
compare each stage's order of forwards and backwards with the schedule's (drawn side by
side when it differs).

Hints
    The two schedules, for p = 4 stages and m = 8 microbatches, one slot per forward (Fk) or
    backward (Bk) of microbatch k, communication drawn as free.

    GPipe (Huang et al. 2019): all forwards, then all backwards (in forward order, microbatch
    0 first, as PyTorch's `torch.distributed.pipelining.ScheduleGPipe` does)::

        stage 0: F0 F1 F2 F3 F4 F5 F6 F7                   B0 B1 B2 B3 B4 B5 B6 B7
        stage 1:    F0 F1 F2 F3 F4 F5 F6 F7             B0 B1 B2 B3 B4 B5 B6 B7
        stage 2:       F0 F1 F2 F3 F4 F5 F6 F7       B0 B1 B2 B3 B4 B5 B6 B7
        stage 3:          F0 F1 F2 F3 F4 F5 F6 F7 B0 B1 B2 B3 B4 B5 B6 B7

    1F1B, a.k.a. PipeDream-Flush (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel
    DNN Training"; Megatron-LM's `forward_backward_pipelining_without_interleaving`)::

        stage 0: F0 F1 F2 F3          B0 F4 B1 F5 B2 F6 B3 F7 B4    B5    B6    B7
        stage 1:    F0 F1 F2       B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5    B6    B7
        stage 2:       F0 F1    B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6    B7
        stage 3:          F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7

    Stage 0 above: warm-up F0 F1 F2; steady state F3 B0 F4 B1 ... F7 B4; cool-down B5 B6 B7.
    (A real backward takes about twice as long as a forward; the picture keeps its shape.)

    Both schedules take `2 (m + p - 1)` slots, of which each stage is idle `2 (p - 1)`: the
    bubble fraction is `(p - 1) / (m + p - 1)` of the step (`(p - 1) / m` of the useful
    compute, as Narayanan et al. write it), so more microbatches mean a smaller bubble. What
    1F1B buys is memory: a GPipe stage keeps the activations of all m microbatches until its
    first backward, a 1F1B stage at most `p - r` (here 4 on stage 0 instead of 8).

    - `send`/`recv` address peers by global rank: `dist.get_global_rank(group, i)` when
      `group` is not None. Split with `torch.tensor_split`; the receiver allocates
      `torch.empty(activation_shape)` before the message arrives.
    - Scale each microbatch's loss by `1 / m` before its backward. Gradients accumulate in
      `.grad` over the microbatches and must equal those of the mean loss over the batch.
    - A received activation is a fresh tensor: call `requires_grad_()` on it before the stage
      uses it, or its `.grad` (what you send back) is never computed.
    - Keep each microbatch's input and output until its backward: the backward of a non-last
      stage is `torch.autograd.backward(output, grad_tensors=grad_from_next)`.
    - Deadlock: on gloo a blocking `dist.send` waits until the peer receives. In the 1F1B
      steady state stage r sends an activation to r + 1 while r + 1 sends a gradient to r;
      if both use blocking sends, both wait forever. Post the send and the matching receive
      together (`dist.batch_isend_irecv`, as Megatron's `send_forward_recv_backward` does),
      or `isend` and wait later. A tensor given to `isend` must stay alive, unmodified, until
      its work is waited.
    - `m < p` is allowed: then some stages have no steady state at all (`min` above).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.distributed as dist
from torch import Tensor, nn

LossFn = Callable[[Tensor, Tensor], Tensor]


def gpipe_step(
    stage: nn.Module,
    inputs: Tensor | None,
    targets: Tensor | None,
    loss_fn: LossFn,
    num_microbatches: int,
    activation_shape: Sequence[int],
    group: dist.ProcessGroup | None = None,
) -> Tensor | None:
    """Run one training step of this rank's pipeline stage with the GPipe schedule.

    - `stage`: this rank's part of the model. `group`: the pipeline's group, `None`: default.
    - `inputs`: the full batch on the first stage, `None` elsewhere; `targets`: the full batch
      of targets on the last stage, `None` elsewhere; `loss_fn(output, target)` returns a
      scalar, called on the last stage.
    - `num_microbatches`: m, the batch splits into m equal chunks along dim 0.
    - `activation_shape`: shape of one microbatch's activation (and of its gradient) sent
      between stages, as float32.
    - Returns, on the last stage, the mean over microbatches of their (unscaled) losses as a
      detached scalar tensor; `None` on every other stage. Afterwards every parameter's
      `.grad` has been increased by the gradient of the mean loss over the full batch.

    Graded and communication as in the module docstring: one activation forward and one
    gradient back per microbatch per boundary, all forwards before any backward.

    Hints
        Forward all m microbatches (receive each activation from the previous stage, run
        `stage`, send the output to the next stage), then backward all of them in the same
        order (receive the output's gradient from the next stage, backpropagate, send the
        input's gradient to the previous stage). The caller zeroes gradients.
    """
    raise NotImplementedError("pipeline_parallel.gpipe_step: not implemented yet")


def one_f_one_b_step(
    stage: nn.Module,
    inputs: Tensor | None,
    targets: Tensor | None,
    loss_fn: LossFn,
    num_microbatches: int,
    activation_shape: Sequence[int],
    group: dist.ProcessGroup | None = None,
) -> Tensor | None:
    """Run one training step of this rank's pipeline stage with the 1F1B schedule.

    Same arguments, return value and gradients as `gpipe_step`; only the order of work
    differs. On stage r of p, with m = `num_microbatches`: `min(p - r - 1, m)` warm-up
    forwards; then, for each remaining microbatch, one forward and the backward of the oldest
    microbatch in flight; then the backwards still pending. At most `p - r` microbatches are
    in flight (forwarded, not yet backwarded) on stage r.

    Graded and communication as in the module docstring, the order of each stage's work
    against the schedule above.

    Hints
        In the steady state, pair each send with the neighbour's send in the other direction
        (send_forward_recv_backward, send_backward_recv_forward) so that no two neighbours
        block on sends to each other; see "Deadlock" in the module hints.
    """
    raise NotImplementedError("pipeline_parallel.one_f_one_b_step: not implemented yet")
