"""The broker's records: one rank's state, one posted operation, and what a call came to."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

import torch

from grader import wire
from grader.broker.accounting import LocalTime, Meter
from grader.failures import Fault
from grader.protocol import OpName, ProtocolError, RankError, TensorMeta, clean, field_int
from grader.segment import BrokerSegment
from grader.wire import Frame


@dataclass(frozen=True)
class Problem:
    """A fault the broker saw itself: what a verdict may rest on."""

    kind: Fault
    message: str


@dataclass(frozen=True)
class Returned:
    """What a rank's call came to: its return value, its arguments as the call left them,
    and the names of those it rebound rather than changed in place (decoded and checked by
    :mod:`grader.wire`)."""

    returned: Any = None
    args: tuple[Any, ...] = ()
    rebound: tuple[str, ...] = ()

    @classmethod
    def read(cls, header: dict[str, Any], buffers: list[bytes]) -> Returned:
        """A result frame's content; ProtocolError unless it is ``{returned, args}``."""
        value = wire.decode(header.get("value"), buffers)
        if not isinstance(value, dict) or set(value) != {"returned", "args"}:
            raise ProtocolError("a result that is not {returned, args}")
        if not isinstance(value["args"], list):
            raise ProtocolError("a result whose args are not a list")
        rebound = header.get("rebound")
        names = tuple(clean(r, 60) for r in rebound[:50]) if isinstance(rebound, list) else ()
        return cls(value["returned"], tuple(value["args"]), names)


@dataclass(frozen=True)
class Gate:
    """A point in a scenario that the rank must pass through the broker, and what it must have
    sent before it.

    The scenario cannot go on without ``secret`` (its result would be wrong), so the point is
    where the scenario's code really is, not where a mark says. The broker hands the secret
    over at once and records whether one of the rank's all-reduces since the previous gate,
    one of every rank of the call (what a group of one carries never leaves the rank),
    carried every value of ``needs`` (as they are, or divided by the group's size): a causal
    fact, from checked payloads, that no mark, clock or order a rank reports can forge.
    """

    label: str
    secret: bytes  # the payload the gate's answer carries
    needs: tuple[float, ...] = ()  # nothing needed: always open

    @classmethod
    def handing(cls, label: str, tensor: torch.Tensor, needs: tuple[float, ...] = ()) -> Gate:
        """The gate ``label`` that hands over ``tensor`` (the scenario gets it in float64:
        :func:`grader.scenarios.gate`)."""
        return cls(label, tensor.detach().double().contiguous().numpy().tobytes(), needs)

    def opened_by(self, event: Any, world: tuple[int, ...]) -> bool:
        """Whether ``event`` opens the gate: an all-reduce of the call's ranks ``world`` that
        carried ``needs``."""
        if not self.needs:
            return True
        if event.op != OpName.ALL_REDUCE or event.group != world:
            return False
        if not event.payload or len(event.payload) > 1 << 24:
            return False
        dtype = wire.DTYPES.get(event.dtype, torch.float32)
        if len(event.payload) % dtype.itemsize:
            return False
        carried = torch.frombuffer(bytearray(event.payload), dtype=dtype).double()
        needs = torch.tensor(self.needs, dtype=torch.float64)
        for wanted in (needs, needs / len(world)):
            gap = (carried[None, :] - wanted[:, None]).abs().amin(dim=1)
            if bool((gap <= 1e-5 * wanted.abs() + 1e-12).all()):  # float32 buckets too
                return True
        return False


@dataclass(frozen=True)
class CollectiveCall:
    """What a rank says of its part in a collective, decoded and checked by the broker."""

    root: int  # a group rank: where a broadcast or a scatter starts, a reduce or a gather ends
    reduce_op: str
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    form: str = ""  # the student's call where it is not the collective's name
    whole: TensorMeta | None = None  # the one tensor that form cut into inputs or outputs

    @classmethod
    def read(cls, header: dict[str, Any]) -> CollectiveCall:
        """From a collective frame's header: a ProtocolError if it breaks the format."""
        inputs, outputs = header.get("inputs", []), header.get("outputs", [])
        if not isinstance(inputs, list) or not isinstance(outputs, list):
            raise ProtocolError("a collective's inputs and outputs must be lists")
        return cls(
            field_int(header, "root", -(1 << 31), 1 << 31) if "root" in header else 0,
            clean(header.get("reduce_op", "sum"), 20),
            tuple(TensorMeta.read(m) for m in inputs),
            tuple(TensorMeta.read(m) for m in outputs),
            clean(header.get("form", ""), 40),
            TensorMeta.read(header["whole"]) if "whole" in header else None,
        )


@dataclass
class Op:
    """One operation a rank posted: a send, a receive or its part of a collective."""

    rank: int
    id: int
    kind: str  # "send", "recv" or a collective's name
    peer: int  # global rank, -1 for a collective
    tag: int
    at: str
    meta: TensorMeta | None = None
    payload: list[bytes] = field(default_factory=list)
    group: tuple[int, ...] = ()  # the global ranks of its process group
    group_peer: int = 0  # a send's or a receive's peer as the rank named it, a group rank
    call: CollectiveCall | None = None  # a collective's part: what the rank said of it
    done: bool = False  # the broker has decided it: matched, computed or refused
    waited: bool = False  # the rank asked for its outcome (wait, is_completed, get_future)
    held: Frame | None = None  # its outcome, kept until the rank asks for it
    refused: bool = False
    event: int = -1  # its position in the rank's traffic record
    echoed: int = 0  # bytes of its outcome that are its own input handed back (a collective's)

    @property
    def collective(self) -> CollectiveCall:
        """The rank's part in the collective this op is (the broker made it one)."""
        if self.call is None:
            raise ValueError(f"{self.kind} is not a collective")
        return self.call

    def describe(self) -> str:
        where = f" at {self.at}" if self.at else ""
        if self.kind == OpName.SEND:
            return f"send to rank {self.peer}{where}"
        if self.kind == OpName.RECV:
            return f"recv from rank {self.peer}{where}"
        return f"{self.kind}{where}"


@dataclass
class RankState:
    """What the broker knows of one rank during a call."""

    rank: int
    sock: socket.socket | None = None
    up: bool = False  # it said hello: its process runs and serves (its wrapper connected it)
    alive: bool = True
    running: bool = False
    blocked_on: Op | None = None
    outcome: Returned | RankError | None = None
    importing: str = ""
    stack: list[str] | None = None
    gates: list[Gate] = field(default_factory=list)  # this call's, in the order they come
    gate_from: int = 0  # the first of its events that may open the next gate
    buffered: int = 0  # bytes the broker holds for this rank's call (see Limits)
    recorded: int = 0  # bytes of its payloads kept in the call's record
    posted: int = 0  # operations and marks posted in this call
    broken: bool = False  # broke the protocol in this call: the call is over for it
    meter: Meter | None = None  # its process's account (None: reached by a relay)
    segment: BrokerSegment | None = None  # its shared memory (None: reached by a relay)
    local: LocalTime = field(default_factory=LocalTime.unmeasured)  # this call's local time

    def start_call(self, gates: list[Gate], timed: bool) -> None:
        """A call begins; ``timed``: its local time is measured (:class:`LocalTime`)."""
        self.running, self.outcome, self.stack, self.broken = True, None, None, False
        measured = timed and self.meter is not None
        self.local = LocalTime() if measured else LocalTime.unmeasured()
        self.buffered = self.posted = self.recorded = self.gate_from = 0
        self.gates = list(gates)

    def record(self, size: int, limits: Limits) -> None:
        """Keep ``size`` more bytes of this rank's payloads in the call's record."""
        self.recorded += size
        if self.recorded > limits.recorded_bytes:
            raise LimitExceeded(
                f"sent more than {limits.recorded_bytes >> 20} MiB in one call (messages and "
                "collectives' inputs)"
            )

    def count(self, limits: Limits) -> None:
        """One more operation, wait or mark of this rank's call, within the limit."""
        self.posted += 1
        if self.posted > limits.operations:
            raise LimitExceeded(
                f"posted more than {limits.operations} operations (sends, receives, "
                "collectives, waits and marks) in one call"
            )


MiB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """What one rank may cost the broker during one call; beyond it, the rank is at fault.

    A rank that floods the grader (sends nobody receives, receives or marks posted in a
    loop) must not exhaust the trusted side's memory: every byte and every record the broker
    keeps for a call is counted against the rank that made it, and against its share of the
    call's one budget (``call_bytes``), which the rank that passes it is blamed for.
    """

    buffered_bytes: int = 256 * MiB  # payloads held: its sends not yet received, its results
    operations: int = 20_000  # sends, receives, collectives, waits and marks per call
    frame_bytes: int = 256 * MiB + MiB  # one frame from a rank, read before anything else
    recorded_bytes: int = 1024 * MiB  # payloads kept in the call's record, for the tests
    # Every rank's payloads kept in the call's record and held for it, and the results a
    # collective is about to make: one budget for the whole call, each rank within its 1/p
    # share, so that p ranks each within the limits above cannot together take a 4 GB
    # grader's memory. A message both held and kept is one copy counted twice.
    call_bytes: int = 1536 * MiB


def itemsize(meta: TensorMeta) -> int:
    dtype = wire.DTYPES.get(meta.dtype)
    if dtype is None:
        raise ProtocolError(f"unknown dtype {meta.dtype!r}")
    return dtype.itemsize


def nbytes(meta: TensorMeta) -> int:
    """The bytes a tensor so described holds."""
    return meta.numel * itemsize(meta)


def tensor_of(meta: TensorMeta, buffer: bytes) -> torch.Tensor:
    dtype = wire.DTYPES[meta.dtype]
    if len(buffer) != nbytes(meta):
        raise ValueError(f"{len(buffer)} bytes for {meta}")
    if not buffer:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(buffer), dtype=torch.uint8).view(dtype)


def describe_collective(op: Op) -> str:
    sizes = ", ".join(map(str, op.collective.inputs))
    root = f" from root {op.collective.root}" if op.kind == OpName.BROADCAST else ""
    return f"{op.kind}{root} of [{sizes}] at {op.at or '?'}"


class LimitExceeded(ProtocolError):
    """A rank went past one of :class:`Limits`: its call is over."""


def check_payload(meta: TensorMeta, buffer: bytes, what: str) -> None:
    """A payload is exactly the tensor its description says, or the sender broke the protocol:
    the bytes counted are the bytes carried."""
    if len(buffer) != nbytes(meta):
        raise ProtocolError(f"{what} declares {meta} but carries {len(buffer)} bytes")
