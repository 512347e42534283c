"""Reference pipeline-parallel schedules: GPipe and 1F1B (PipeDream-Flush).

Stage ``i`` of a ``p``-stage pipeline runs on rank ``i`` of ``group``. One training step
splits the batch into ``m`` microbatches; each stage sends every microbatch's activation
forward to the next stage and receives its gradient back (send_forward / recv_forward /
send_backward / recv_backward, in the vocabulary of Megatron-LM and
``torch.distributed.pipelining``).

- GPipe (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using
  Pipeline Parallelism"): all ``m`` forwards, then all ``m`` backwards. Every stage holds
  the activations of all ``m`` microbatches at the peak.
- 1F1B (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training", the
  PipeDream-Flush schedule; Megatron-LM's ``forward_backward_pipelining_without_interleaving``):
  a warm-up of ``min(p - rank - 1, m)`` forwards, a steady state of one forward then one
  backward, and a cool-down (drain) of the remaining backwards. Same bubble as GPipe,
  ``(p - 1) / (m + p - 1)`` of the step, but at most ``p - rank`` microbatches are in
  flight on a stage, so activation memory no longer grows with ``m``.

Activations and their gradients travel as float32 tensors of ``activation_shape``: the
receiver must allocate its buffer before the message arrives, so shape and dtype are fixed
in advance, as in Megatron (``tensor_shape``, ``dtype``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

ACTIVATION_DTYPE = torch.float32
"""dtype of every activation and activation gradient sent between stages."""

LossFn = Callable[[Tensor, Tensor], Tensor]


class _PipelineStage:
    """One rank's stage: its microbatches, its compute steps and its links to its neighbours."""

    def __init__(
        self,
        stage: nn.Module,
        inputs: Tensor | None,
        targets: Tensor | None,
        loss_fn: LossFn,
        num_microbatches: int,
        activation_shape: Sequence[int],
        group: dist.ProcessGroup | None,
    ) -> None:
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")
        self.stage, self.loss_fn, self.num_microbatches = stage, loss_fn, num_microbatches
        self.activation_shape = tuple(activation_shape)
        self.group = group
        self.rank, self.num_stages = dist.get_rank(group), dist.get_world_size(group)
        self.is_first, self.is_last = self.rank == 0, self.rank == self.num_stages - 1
        self.prev_peer = None if self.is_first else self._global_rank(self.rank - 1)
        self.next_peer = None if self.is_last else self._global_rank(self.rank + 1)
        self.input_chunks = self._split(inputs, "inputs") if self.is_first else None
        self.target_chunks = self._split(targets, "targets") if self.is_last else None
        self.losses: list[Tensor] = []

    def _global_rank(self, group_rank: int) -> int:
        # send/recv address peers by global rank; the default group's ranks already are.
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def _split(self, batch: Tensor | None, name: str) -> tuple[Tensor, ...]:
        if batch is None:
            raise ValueError(f"{name} must be given on stage {self.rank}")
        if batch.shape[0] % self.num_microbatches != 0:
            raise ValueError(
                f"{name}: {batch.shape[0]} rows do not split into "
                f"{self.num_microbatches} equal microbatches"
            )
        return torch.tensor_split(batch, self.num_microbatches)

    # -- communication ----------------------------------------------------------------------
    # A blocking gloo send returns only once the peer has received. In 1F1B's steady state a
    # stage sends an activation forward while its successor sends a gradient backward: with
    # blocking sends each waits for the other's receive and both hang forever. The cure, as in
    # Megatron's send_forward_recv_backward, is to post the send *and* the receive together
    # (batch_isend_irecv) and only then wait: each neighbour's receive is already posted when
    # the other's send needs it. GPipe sends in one direction at a time and never meets this.
    # The send buffer lives in `ops` until its work is waited, so it cannot be freed early.

    def _exchange(
        self, send: Tensor | None, send_to: int | None, recv_from: int | None
    ) -> Tensor | None:
        """Send ``send`` to ``send_to`` and receive from ``recv_from`` (``None``: skip)."""
        ops, received = [], None
        if send_to is not None:
            assert send is not None
            if tuple(send.shape) != self.activation_shape or send.dtype != ACTIVATION_DTYPE:
                raise ValueError(
                    f"stage {self.rank} sends {tuple(send.shape)} {send.dtype}, "
                    f"expected {self.activation_shape} {ACTIVATION_DTYPE}"
                )
            ops.append(dist.P2POp(dist.isend, send.detach().contiguous(), send_to, self.group))
        if recv_from is not None:
            received = torch.empty(self.activation_shape, dtype=ACTIVATION_DTYPE)
            ops.append(dist.P2POp(dist.irecv, received, recv_from, self.group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return received

    def recv_forward(self) -> Tensor | None:
        # The received activation is a leaf of this stage's graph; its .grad is what we send back.
        received = self._exchange(None, None, self.prev_peer)
        return None if received is None else received.requires_grad_()

    def send_forward(self, output: Tensor) -> None:
        self._exchange(output, self.next_peer, None)

    def recv_backward(self) -> Tensor | None:
        return self._exchange(None, None, self.next_peer)

    def send_backward(self, input_grad: Tensor | None) -> None:
        self._exchange(input_grad, self.prev_peer, None)

    def send_forward_recv_backward(self, output: Tensor) -> Tensor | None:
        return self._exchange(output, self.next_peer, self.next_peer)

    def send_backward_recv_forward(self, input_grad: Tensor | None) -> Tensor | None:
        received = self._exchange(input_grad, self.prev_peer, self.prev_peer)
        return None if received is None else received.requires_grad_()

    # -- computation ------------------------------------------------------------------------

    def forward_step(self, microbatch: int, input_tensor: Tensor | None) -> Tensor:
        """Run the stage on one microbatch; on the last stage, return its loss scaled by 1/m.

        The first stage reads its input from ``inputs`` (``input_tensor`` is ``None``).
        Scaling by ``1/m`` makes the gradients accumulated over the ``m`` microbatches those
        of the mean loss over the full batch.
        """
        x = self.input_chunks[microbatch] if self.input_chunks is not None else input_tensor
        output = self.stage(x)
        if self.target_chunks is None:
            return output
        loss = self.loss_fn(output, self.target_chunks[microbatch])
        self.losses.append(loss.detach())
        return loss / self.num_microbatches

    def backward_step(
        self, input_tensor: Tensor | None, output: Tensor, output_grad: Tensor | None
    ) -> Tensor | None:
        """Backpropagate one microbatch; return the gradient for the previous stage."""
        if output.requires_grad:  # a parameterless first stage has nothing to differentiate
            torch.autograd.backward(output, grad_tensors=output_grad)  # None on the last stage
        if input_tensor is None:  # first stage: nothing to send back
            return None
        # An output that ignores its input leaves .grad unset; the gradient is then zero.
        grad = input_tensor.grad
        return torch.zeros_like(input_tensor) if grad is None else grad

    def mean_loss(self) -> Tensor | None:
        return torch.stack(self.losses).mean() if self.is_last else None


def gpipe_step(
    stage: nn.Module,
    inputs: Tensor | None,
    targets: Tensor | None,
    loss_fn: LossFn,
    num_microbatches: int,
    activation_shape: Sequence[int],
    group: dist.ProcessGroup | None = None,
) -> Tensor | None:
    """One GPipe step: forward every microbatch, then backward every microbatch.

    Backwards run in forward order (microbatch 0 first), as PyTorch's ``ScheduleGPipe``
    does; the order does not change the gradients. Gradients accumulate into ``.grad``
    (the caller zeroes them). Returns the detached mean loss on the last stage, else None.
    """
    pipe = _PipelineStage(
        stage, inputs, targets, loss_fn, num_microbatches, activation_shape, group
    )
    saved: deque[tuple[Tensor | None, Tensor]] = deque()
    for microbatch in range(num_microbatches):
        input_tensor = pipe.recv_forward()
        output = pipe.forward_step(microbatch, input_tensor)
        pipe.send_forward(output)
        saved.append((input_tensor, output))  # all m activations are alive at the peak
    while saved:
        input_tensor, output = saved.popleft()
        pipe.send_backward(pipe.backward_step(input_tensor, output, pipe.recv_backward()))
    return pipe.mean_loss()


def one_f_one_b_step(
    stage: nn.Module,
    inputs: Tensor | None,
    targets: Tensor | None,
    loss_fn: LossFn,
    num_microbatches: int,
    activation_shape: Sequence[int],
    group: dist.ProcessGroup | None = None,
) -> Tensor | None:
    """One 1F1B (PipeDream-Flush) step: warm-up, steady state of 1F1B, cool-down.

    Follows Megatron-LM's ``forward_backward_pipelining_without_interleaving``. Stage ``r``
    runs ``min(p - r - 1, m)`` warm-up forwards, so that the last stage can start its first
    backward as soon as its first forward is done; it then alternates one forward and one
    backward, holding at most ``p - r`` microbatches in flight, and drains the backwards
    left over. Same arguments, result and gradients as :func:`gpipe_step`.
    """
    pipe = _PipelineStage(
        stage, inputs, targets, loss_fn, num_microbatches, activation_shape, group
    )
    num_warmup = min(pipe.num_stages - pipe.rank - 1, num_microbatches)
    num_steady = num_microbatches - num_warmup
    in_flight: deque[tuple[Tensor | None, Tensor]] = deque()

    # Warm-up: forwards only; no gradient can have come back yet.
    for microbatch in range(num_warmup):
        input_tensor = pipe.recv_forward()
        output = pipe.forward_step(microbatch, input_tensor)
        pipe.send_forward(output)
        in_flight.append((input_tensor, output))

    # Steady state: forward microbatch `num_warmup + i`, backward microbatch `i`. Each send
    # is paired with the receive the neighbour is about to need, so neither side blocks.
    input_tensor = pipe.recv_forward() if num_steady > 0 else None
    for i in range(num_steady):
        output = pipe.forward_step(num_warmup + i, input_tensor)
        output_grad = pipe.send_forward_recv_backward(output)
        in_flight.append((input_tensor, output))
        oldest_input, oldest_output = in_flight.popleft()
        input_grad = pipe.backward_step(oldest_input, oldest_output, output_grad)
        if i == num_steady - 1:
            pipe.send_backward(input_grad)  # no forward is left to receive
        else:
            input_tensor = pipe.send_backward_recv_forward(input_grad)

    # Cool-down (drain): the backwards of the warm-up microbatches.
    while in_flight:
        input_tensor, output = in_flight.popleft()
        pipe.send_backward(pipe.backward_step(input_tensor, output, pipe.recv_backward()))
    return pipe.mean_loss()
