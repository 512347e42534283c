"""A call's operations on the broker's side: queued, matched, computed, delivered, judged.

Sends and receives are matched in order per (source, destination, tag), as MPI and gloo
match them; a collective runs once every member of its group posted it. What an operation
received reaches its rank only when the rank waits for it. Every fault found on the way
(a size mismatch, a bad peer, a deadlock, a message never received, a limit passed) is a
:class:`~grader.broker.ops.Problem` of the call, with the operation refused to its rank.
:class:`grader.broker.server.Broker` reads the frames and calls these rules.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Any

from grader import protocol, wire
from grader.broker import collectives, faults
from grader.broker.connections import Connections
from grader.broker.ops import Limits, Op, Problem, RankState, Returned, nbytes
from grader.broker.traffic import Event, Traffic
from grader.failures import Fault
from grader.protocol import OpName, ProtocolError, RankError, TensorMeta, clean, field_int
from grader.wire import Frame


class Matching:
    """The state of the current call, and the rules that move its operations along; what it
    hands a rank goes out through ``connections`` (under their lock, as every call here)."""

    def __init__(self, connections: Connections, limits: Limits) -> None:
        self.connections = connections
        self.limits = limits
        self.active = connections.world_size  # the ranks of the current call: 0..active-1
        self.keep_payloads = True  # the call's record keeps what each operation carried
        self.forbid_collectives = False  # the part allows none of torch's collectives
        self.reset_call()

    def holds(self, frame: Frame) -> bool:
        """A message's payload stays in its sender's ring until handed over, in a call whose
        record keeps no payloads: then nothing but its receiver reads it."""
        return not self.keep_payloads and frame.header.get("type") == protocol.SEND

    def records(self, rank: int) -> tuple[int, int]:
        if rank >= len(self.traffic.per_rank):
            return 0, 0
        return len(self.traffic.per_rank[rank]), len(self.traffic.waits[rank])

    # -- matching ------------------------------------------------------------------------------

    def new_op(self, state: RankState, frame: Frame, kind: str) -> Op:
        if not state.running:
            raise ProtocolError("an operation outside of any call")
        state.count(self.limits)
        header = frame.header
        op = Op(
            state.rank,
            field_int(header, "op", 0),
            kind,
            -1,
            field_int(header, "tag", -(1 << 31), 1 << 31) if "tag" in header else 0,
            clean(header.get("at", ""), 200),
            TensorMeta.read(header) if "dtype" in header else None,
        )
        if (state.rank, op.id) in self.ops:
            raise ProtocolError("an operation id used twice")
        self.ops[(state.rank, op.id)] = op
        if kind in (OpName.SEND, OpName.RECV):
            group = protocol.field_ranks(header, self.active)
            peer = field_int(header, "peer")
            op.peer = group[peer] if 0 <= peer < len(group) else -2 - peer
            op.group, op.group_peer = group, peer
        return op

    def check_peer(self, op: Op) -> bool:
        group = op.group
        if op.peer >= 0 and op.peer != op.rank:
            return True
        peer = op.group_peer
        direction = "to" if op.kind == OpName.SEND else "from"
        reason = (
            "itself"
            if op.peer == op.rank
            else f"rank {peer}, but the group has ranks 0..{len(group) - 1}"
        )
        self.fault(
            Fault.BAD_PEER,
            f"rank {op.rank}: {op.kind} {direction} {reason} (at {op.at or '?'})",
        )
        self.refuse(op, f"{op.kind} {direction} {reason}")
        return False

    def queue(self, queues: dict[tuple[int, int, int], deque[Op]], key: Any, op: Op) -> None:
        queues[key].append(op)
        op.event = len(self.traffic.per_rank[op.rank])
        self.traffic.per_rank[op.rank].append(
            Event(
                op.kind,
                op.peer,
                nbytes(op.meta) if op.meta else 0,
                op.tag,
                at=op.at,
                dtype=op.meta.dtype if op.meta else "",
                payload=op.payload[0] if op.payload and self.keep_payloads else b"",
            )
        )
        sends, recvs = self.sends[key], self.recvs[key]
        while sends and recvs:
            self._match(sends.popleft(), recvs.popleft())

    def _match(self, send: Op, recv: Op) -> None:
        assert send.meta is not None and recv.meta is not None
        size = len(send.payload[0])
        expected = nbytes(recv.meta)
        if send.meta.dtype != recv.meta.dtype or size != expected:
            self.fault(
                Fault.MISMATCH,
                f"rank {send.rank} sent {size} bytes ({send.meta}) to rank {recv.rank} "
                f"(at {send.at or '?'}), which posted a receive of {expected} bytes "
                f"({recv.meta}) (at {recv.at or '?'})",
            )
            self.refuse(send, "the receive posted for this message has another size or dtype")
            self.refuse(recv, "the message sent here has another size or dtype")
            return
        self.connections.ranks[send.rank].buffered -= size  # the payload is the receiver's now
        payload, send.payload = send.payload, []
        self.complete(recv, payload)
        self.complete(send, [])

    def run_collective(self, members: list[Op]) -> None:
        if not self._affords(members):
            return
        try:
            outputs = collectives.run(members)
        except collectives.CollectiveError as err:
            self.fault(Fault.DISAGREEMENT, str(err))
            for member in members:
                self.refuse(member, str(err))
            return
        finally:
            for op in members:  # the inputs are consumed; the outputs are held until waited
                self.connections.ranks[op.rank].buffered -= sum(map(len, op.payload))
                op.payload = []
        for position, (op, tensors) in enumerate(zip(members, outputs, strict=True)):
            buffers = [wire.tensor_buffer(t) for t in tensors]
            op.echoed = echoed(op, position, buffers)
            self.complete(op, buffers)

    def complete(self, op: Op, buffers: list[bytes]) -> None:
        """The op succeeded. What it received reaches its rank when the rank waits for it."""
        op.done = True
        op.held = Frame({"type": protocol.DONE, "op": op.id}, buffers)
        self.connections.ranks[op.rank].buffered += sum(map(len, buffers))
        if op.waited or op.kind == OpName.SEND:
            self.deliver(op)

    def refuse(self, op: Op, message: str) -> None:
        op.done = op.refused = True
        op.held = Frame({"type": protocol.REFUSED, "op": op.id, "message": message})
        self.deliver(op)

    def deliver(self, op: Op) -> None:
        """Hand the op's outcome to its rank, which runs again if it was blocked on it."""
        frame, op.held = op.held, None
        assert frame is not None
        state = self.connections.ranks[op.rank]
        state.buffered -= sum(map(len, frame.buffers))
        if op.rank < len(self.traffic.delivered):  # what came from other ranks
            self.traffic.delivered[op.rank] += sum(map(len, frame.buffers)) - op.echoed
            if op.kind == OpName.RECV and op.event >= 0:
                self.traffic.handed[(op.rank, op.event)] = len(self.traffic.per_rank[op.rank])
        woken = state.blocked_on is op and state.running and state.local.measured
        # Its figures just before the write that wakes it (a reading, some 10 µs, in a timed
        # call only): what its threads ran while it waited is CPU, never time free later.
        figures = state.meter.read() if woken and state.meter is not None else None
        sent = self.connections.send(op.rank, frame)
        if state.blocked_on is op:
            state.blocked_on = None
            if woken:
                self.connections.release(op.rank, figures, sent)

    # -- the call's budget ------------------------------------------------------------------------

    def _in_call(self) -> int:
        """The bytes the call keeps in the grader now: every rank's payloads held and kept in
        the record."""
        return sum(s.buffered + s.recorded for s in self.connections.ranks[: self.active])

    def _affords(self, members: list[Op]) -> bool:
        """Whether the call's budget holds the results the collective of ``members`` would
        make; if not, it is refused to every member, each at fault."""
        made = collectives.produced(members)
        if self._in_call() + made <= self.limits.call_bytes:
            return True
        limit, first = self.limits.call_bytes >> 20, members[0]
        ranks = ", ".join(str(op.rank) for op in members)
        self.fault(
            Fault.LIMIT,
            f"ranks {ranks}: the {first.describe()} would make {made >> 20} MiB of results, "
            f"past the {limit} MiB the grader keeps for one call",
        )
        for op in members:
            self.connections.ranks[op.rank].buffered -= sum(map(len, op.payload))
            op.payload = []
            self.refuse(op, f"its results would pass the {limit} MiB the grader keeps for a call")
        return False

    # -- faults ----------------------------------------------------------------------------------

    def fault(self, kind: Fault, message: str) -> None:
        self.problems.append(Problem(kind, clean(message)))

    def check_deadlock(self) -> None:
        message = faults.deadlock(self.connections.ranks[: self.active])
        if message is not None:
            self.fault(Fault.DEADLOCK, message)
            for state in self.connections.ranks[: self.active]:
                if state.blocked_on is not None:
                    self.refuse(state.blocked_on, "deadlock: no rank can make progress")

    def finish(self, state: RankState, outcome: Returned | RankError) -> None:
        state.outcome = outcome
        state.running = False
        state.blocked_on = None
        if all(r.outcome is not None for r in self.connections.ranks[: self.active]):
            self._ended()
        self.check_deadlock()

    def _ended(self) -> None:
        """Every rank's call is over: so is its local time, with a reading of each timed one
        (what a rank ran after its result, while the call went on, is its own)."""
        for state in self.connections.ranks[: self.active]:
            if state.local.measured and state.meter is not None:
                state.local.ended(state.meter.read(), self.records(state.rank))

    def check_leftovers(self) -> None:
        """At the end of a call: messages sent and never received, receives never matched."""
        if self._leftovers_checked:
            return
        self._leftovers_checked = True
        for op, message, reason in faults.leftovers(self.sends, self.recvs):
            self.fault(Fault.UNRECEIVED, message)
            self.refuse(op, reason)
        for message in faults.never_waited(self.ops.values()):
            self.fault(Fault.UNWAITED, message)

    def reset_call(self) -> None:
        self.problems: list[Problem] = []
        self.traffic = Traffic.empty(self.active)
        self.sends: dict[tuple[int, int, int], deque[Op]] = defaultdict(deque)
        self.recvs: dict[tuple[int, int, int], deque[Op]] = defaultdict(deque)
        self.ops: dict[tuple[int, int], Op] = {}
        self.pending: dict[tuple[tuple[int, ...], int], dict[int, Op]] = {}
        self.sequence: dict[tuple[int, tuple[int, ...]], int] = defaultdict(int)
        self._leftovers_checked = False
        for state in self.connections.ranks:  # the last call's messages never handed over
            if state.segment is not None:
                state.segment.unhold()


def echoed(op: Op, position: int, outputs: list[bytes]) -> int:
    """The bytes of a collective's ``outputs`` that are the member's own input handed back
    (``position``: its place in the group), which no other rank sent it: all of them in a
    group of one, or to a broadcast's root; its own piece of an all-gather or an all-to-all.
    A reduction's result depends on every member's input: none of it is the member's own."""
    if len(op.group) == 1 or (op.kind == OpName.BROADCAST and op.collective.root == position):
        return sum(map(len, outputs))
    if op.kind in (OpName.ALL_GATHER, OpName.ALL_TO_ALL) and position < len(outputs):
        return len(outputs[position])
    return 0
