"""The ``broker`` process-group backend: every message and collective goes to the trusted broker.

Registered with ``torch.distributed.Backend.register_backend``, it is what
``dist.send``, ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv`` and the
collectives reach: the student keeps the public ``torch.distributed`` API,
and the grader sees every byte. There is no other path between ranks (each
rank is in a network namespace of its own), so nothing can be sent that the
broker does not count.

A send completes when its receive is posted (gloo's and MPI's synchronous
send): two ranks that both block in ``send`` to each other deadlock here as
they would on a cluster, and the broker says so at once. Collectives are
computed by the broker from every rank's contribution; in a part that must
build them from messages the broker refuses them instead.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from grader import protocol
from grader.device import Device
from grader.protocol import Form, OpName
from grader.rank.frames import student_location
from grader.rank.link import BrokerLink, PendingOp
from grader.wire import Frame

BACKEND_NAME = "broker"


class BrokerWork(dist._Work):
    """A posted operation as torch sees it: ``wait()`` blocks until the broker completes it."""

    def __init__(self, link: BrokerLink, op: PendingOp, result: list[torch.Tensor]) -> None:
        super().__init__()
        self._link = link
        self._op = op
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        self._result = result

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._op.wait(self._link)
        if not self._future.done():
            self._future.set_result(self._result)
        return True

    def is_completed(self) -> bool:
        self._op.ask(self._link)  # a test, as MPI_Test: the outcome is wanted from here on
        return self._op.done.is_set()

    def is_success(self) -> bool:
        return self.is_completed() and self._op.error is None

    def get_future(self) -> torch.futures.Future[Any]:
        self._op.ask(self._link)  # the future completes once the broker hands the result over
        return self._future

    def _finish(self) -> None:
        """Called on the link's reader thread when the broker answered."""
        if self._op.error is None and not self._future.done():
            self._future.set_result(self._result)


class BrokerGroup(dist.ProcessGroup):
    def __init__(self, link: BrokerLink, rank: int, size: int, global_ranks: list[int]) -> None:
        super().__init__(rank, size)
        self._link = link
        self._global = global_ranks

    def getBackendName(self) -> str:
        return BACKEND_NAME

    # -- point to point ----------------------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> BrokerWork:
        (tensor,) = tensors
        _check_contiguous(tensor, OpName.SEND)
        return self._post(
            protocol.SEND,
            [tensor],
            [],
            lambda frame: None,
            peer=dst,
            group=self._global,
            tag=tag,
            **_meta(tensor),
        )

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> BrokerWork:
        (tensor,) = tensors
        _check_contiguous(tensor, OpName.RECV)

        def deliver(frame: Frame) -> None:
            _fill(tensor, frame.buffers[0])

        return self._post(
            protocol.RECV,
            [],
            [tensor],
            deliver,
            peer=src,
            group=self._global,
            tag=tag,
            **_meta(tensor),
        )

    # -- collectives: computed by the broker, or refused where the part forbids them ----------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> BrokerWork:
        return self._collective(OpName.ALL_REDUCE, tensors, tensors, reduce_op=_op_name(opts))

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> BrokerWork:
        op = _op_name(opts)
        return self._collective(OpName.REDUCE, tensors, tensors, root=opts.rootRank, reduce_op=op)

    def gather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any
    ) -> BrokerWork:
        """The root's ``outputs`` hold one list of ``p`` tensors, the other ranks' none."""
        flat = [t for out in outputs for t in out]
        return self._collective(OpName.GATHER, inputs, flat, root=opts.rootRank)

    def scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any
    ) -> BrokerWork:
        """The root's ``inputs`` hold one list of ``p`` tensors, the other ranks' none."""
        flat = [t for per_rank in inputs for t in per_rank]
        return self._collective(OpName.SCATTER, flat, outputs, root=opts.rootRank)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any) -> BrokerWork:
        return self._collective(OpName.ALL_REDUCE, tensors, tensors, reduce_op=_op_name(opts))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> BrokerWork:
        return self._collective(OpName.BROADCAST, tensors, tensors, root=opts.rootRank)

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any
    ) -> BrokerWork:
        return self._collective(OpName.ALL_GATHER, inputs, [t for out in outputs for t in out])

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any
    ) -> BrokerWork:
        flat = [t for per_rank in inputs for t in per_rank]
        return self._collective(OpName.REDUCE_SCATTER, flat, outputs, reduce_op=_op_name(opts))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> BrokerWork:
        """``all_gather_into_tensor`` (``all_gather_single`` in torch 2.13): rank r's input
        lands in the r-th of ``p`` equal, consecutive pieces of ``output``."""
        pieces = _pieces(output, input.numel(), self.size(), "output")
        form = Form.ALL_GATHER_INTO_TENSOR
        return self._collective(OpName.ALL_GATHER, [input], pieces, form=form, whole=_meta(output))

    _allgather_base = all_gather_single  # the name before torch 2.13

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any
    ) -> BrokerWork:
        """``reduce_scatter_tensor``: the r-th of ``p`` equal pieces of ``input``, reduced over
        the ranks, lands in rank r's ``output``."""
        pieces = _pieces(input, output.numel(), self.size(), "input")
        return self._collective(
            OpName.REDUCE_SCATTER, pieces, [output], reduce_op=_op_name(opts),
            form=Form.REDUCE_SCATTER_TENSOR, whole=_meta(input),
        )  # fmt: skip

    _reduce_scatter_base = reduce_scatter_single

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        opts: Any,
    ) -> BrokerWork:
        """Rows ``input_splits[j]`` of ``input`` go to rank j; rank j's rows for this rank land in
        ``output``'s ``output_splits[j]`` rows (equal splits of the first dimension if empty)."""
        pieces = _split(input, input_splits, self.size(), "input")
        outputs = _split(output, output_splits, self.size(), "output")
        form = Form.ALL_TO_ALL_SINGLE
        return self._collective(OpName.ALL_TO_ALL, pieces, outputs, form=form, whole=_meta(input))

    alltoall_base = all_to_all_single  # the name before torch 2.13

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> BrokerWork:
        return self._collective(OpName.ALL_TO_ALL, inputs, outputs)

    def barrier(self, opts: Any) -> BrokerWork:
        return self._collective(OpName.BARRIER, [], [])

    # -- plumbing --------------------------------------------------------------------------------

    def _collective(
        self, name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor], **extra: Any
    ) -> BrokerWork:
        def deliver(frame: Frame) -> None:
            for tensor, buffer in zip(outputs, frame.buffers, strict=True):
                _fill(tensor, buffer)

        return self._post(
            protocol.COLLECTIVE,
            list(inputs),
            outputs,
            deliver,
            name=name,
            group=self._global,
            inputs=[_meta(t) for t in inputs],
            outputs=[_meta(t) for t in outputs],
            **extra,
        )

    def _post(
        self,
        kind: str,
        buffers: list[torch.Tensor],
        result: list[torch.Tensor],
        deliver: Callable[[Frame], None],
        **header: Any,
    ) -> BrokerWork:
        work: BrokerWork | None = None

        def on_done(frame: Frame) -> None:
            deliver(frame)
            if work is not None:
                work._finish()

        op = self._link.start_op(kind, on_done, buffers, at=student_location(), **header)
        work = BrokerWork(self._link, op, result)
        if op.done.is_set():
            work._finish()
        return work


def _check_contiguous(tensor: torch.Tensor, what: str) -> None:
    """gloo and NCCL refuse a message in a non-contiguous tensor (a transposed or sliced
    view): so does the broker, with the fix."""
    if not tensor.is_contiguous():
        shape = "x".join(map(str, tensor.shape))
        raise ValueError(
            f"input tensor has to be contiguous: {what} of a non-contiguous {tensor.dtype} "
            f"view [{shape}] with strides {tuple(tensor.stride())} (gloo and NCCL refuse it "
            f"too); {what} a contiguous buffer instead: "
            + (
                "buf = t.contiguous()"
                if what == OpName.SEND
                else "buf = torch.empty_like(t, memory_format=torch.contiguous_format), then "
                "t.copy_(buf) once it has arrived"
            )
        )


def _meta(tensor: torch.Tensor) -> dict[str, Any]:
    """The tensor as the broker needs it: dtype and size, and for its refusals (gloo refuses
    some shapes and views) the shape and strides of the student's tensor."""
    return {
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "numel": tensor.numel(),
        "shape": list(tensor.shape),
        "strides": list(tensor.stride()),
    }


def _fill(tensor: torch.Tensor, buffer: bytearray | memoryview) -> None:
    """Copy what arrived (a frame's buffer, or a view of the segment) into ``tensor``."""
    if len(buffer) != tensor.numel() * tensor.element_size():
        raise ValueError(f"{len(buffer)} bytes arrived for a tensor of {tensor.numel()} elements")
    if buffer:
        data = torch.frombuffer(buffer, dtype=torch.uint8).view(tensor.dtype)
        with torch.no_grad():
            tensor.copy_(data.view(tensor.shape))


def _split(tensor: torch.Tensor, sizes: list[int], parts: int, what: str) -> list[torch.Tensor]:
    """``tensor``'s first dimension cut into ``sizes`` rows each, or into ``parts`` equal parts,
    as ``all_to_all_single`` cuts it on gloo and NCCL (and refuses to, with the same causes)."""
    if tensor.dim() == 0:
        raise ValueError(f"all_to_all_single: the {what} must have at least one dimension")
    rows = tensor.shape[0]
    if not sizes:
        if rows % parts:
            raise ValueError(
                f"all_to_all_single: the {what}'s first dimension ({rows}) is not divisible by "
                f"the group size ({parts}); pass split sizes for uneven splits"
            )
        sizes = [rows // parts] * parts
    if len(sizes) != parts or sum(sizes) != rows or min(sizes) < 0:
        raise ValueError(
            f"all_to_all_single: {what} split sizes {list(sizes)} must be {parts} sizes, none "
            f"negative, adding up to the {what}'s first dimension ({rows})"
        )
    return list(tensor.split(list(sizes)))


def _pieces(whole: torch.Tensor, size: int, parts: int, whole_name: str) -> list[torch.Tensor]:
    """``whole`` as ``parts`` consecutive flat views of ``size`` elements each: written into,
    they write into ``whole``. If ``whole`` does not hold ``parts`` times ``size``
    elements (none then): the broker refuses that call, naming the shape gloo wants
    (:mod:`grader.broker.rules`)."""
    if whole.numel() != size * parts:
        return []
    if not whole.is_contiguous():
        raise ValueError(f"the {whole_name} tensor must be contiguous (NCCL refuses it too)")
    return list(whole.view(-1).split(size)) if size else [whole.view(-1)] * parts


def _op_name(opts: Any) -> str:
    """``ReduceOp.SUM`` as "sum": torch wraps the enum member in a ``ReduceOp`` object."""
    op = getattr(opts.reduceOp, "op", opts.reduceOp)
    name = getattr(op, "name", None) or str(op)
    return name.rsplit(".", 1)[-1].lower()


def register(link: BrokerLink) -> None:
    """Make ``init_process_group("broker")`` and ``new_group`` build groups on ``link``."""

    def create(options: Any, backend_options: Any = None) -> BrokerGroup:
        ranks = list(options.global_ranks_in_group) or list(range(options.group_size))
        return BrokerGroup(link, options.group_rank, options.group_size, ranks)

    dist.Backend.register_backend(
        BACKEND_NAME, create, extended_api=True, devices=[d.value for d in Device]
    )
