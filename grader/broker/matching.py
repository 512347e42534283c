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
from grader.broker.ops import LimitExceeded, Limits, Op, Problem, RankState, Returned, nbytes
from grader.broker.traffic import Event, Traffic
from grader.failures import Fault
from grader.protocol import OpName, ProtocolError, RankError, TensorMeta, clean, field_int
from grader.wire import Frame


class Matching(Connections):
    """The state of the current call, and the rules that move its operations along."""

    def __init__(self, world_size: int, limits: Limits) -> None:
        self.limits = limits
        super().__init__(world_size, limits.frame_bytes)
        self.active = world_size  # the ranks of the current call: 0..active-1
        self.keep_payloads = True  # the call's record keeps what each operation carried
        self._reset_call()

    def _holds(self, frame: Frame) -> bool:
        """A message's payload stays in its sender's ring until handed over, in a call whose
        record keeps no payloads: then nothing but its receiver reads it."""
        return not self.keep_payloads and frame.header.get("type") == protocol.SEND

    def _records(self, rank: int) -> tuple[int, int]:
        if rank >= len(self.traffic.per_rank):
            return 0, 0
        return len(self.traffic.per_rank[rank]), len(self.traffic.waits[rank])

    # -- matching ------------------------------------------------------------------------------

    def _op(self, state: RankState, frame: Frame, kind: str) -> Op:
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
        if (state.rank, op.id) in self._ops:
            raise ProtocolError("an operation id used twice")
        self._ops[(state.rank, op.id)] = op
        if kind in (OpName.SEND, OpName.RECV):
            group = protocol.field_ranks(header, self.active)
            peer = field_int(header, "peer")
            op.peer = group[peer] if 0 <= peer < len(group) else -2 - peer
            op.group, op.group_peer = group, peer
        return op

    def _check_peer(self, op: Op) -> bool:
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
        self._fault(
            Fault.BAD_PEER,
            f"rank {op.rank}: {op.kind} {direction} {reason} (at {op.at or '?'})",
        )
        self._refuse(op, f"{op.kind} {direction} {reason}")
        return False

    def _queue(self, queues: dict[tuple[int, int, int], deque[Op]], key: Any, op: Op) -> None:
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
        sends, recvs = self._sends[key], self._recvs[key]
        while sends and recvs:
            self._match(sends.popleft(), recvs.popleft())

    def _match(self, send: Op, recv: Op) -> None:
        assert send.meta is not None and recv.meta is not None
        size = len(send.payload[0])
        expected = nbytes(recv.meta)
        if send.meta.dtype != recv.meta.dtype or size != expected:
            self._fault(
                Fault.MISMATCH,
                f"rank {send.rank} sent {size} bytes ({send.meta}) to rank {recv.rank} "
                f"(at {send.at or '?'}), which posted a receive of {expected} bytes "
                f"({recv.meta}) (at {recv.at or '?'})",
            )
            self._refuse(send, "the receive posted for this message has another size or dtype")
            self._refuse(recv, "the message sent here has another size or dtype")
            return
        self._ranks[send.rank].buffered -= size  # the payload is the receiver's now
        payload, send.payload = send.payload, []
        self._complete(recv, payload)
        self._complete(send, [])

    def _run_collective(self, members: list[Op]) -> None:
        if not self._affords(members):
            return
        try:
            outputs = collectives.run(members)
        except collectives.CollectiveError as err:
            self._fault(Fault.DISAGREEMENT, str(err))
            for member in members:
                self._refuse(member, str(err))
            return
        finally:
            for op in members:  # the inputs are consumed; the outputs are held until waited
                self._ranks[op.rank].buffered -= sum(map(len, op.payload))
                op.payload = []
        for position, (op, tensors) in enumerate(zip(members, outputs, strict=True)):
            buffers = [wire.tensor_buffer(t) for t in tensors]
            op.echoed = echoed(op, position, buffers)
            self._complete(op, buffers)

    def _complete(self, op: Op, buffers: list[bytes]) -> None:
        """The op succeeded. What it received reaches its rank when the rank waits for it."""
        op.done = True
        op.held = Frame({"type": protocol.DONE, "op": op.id}, buffers)
        self._ranks[op.rank].buffered += sum(map(len, buffers))
        if op.waited or op.kind == OpName.SEND:
            self._deliver(op)

    def _refuse(self, op: Op, message: str) -> None:
        op.done = op.refused = True
        op.held = Frame({"type": protocol.REFUSED, "op": op.id, "message": message})
        self._deliver(op)

    def _deliver(self, op: Op) -> None:
        """Hand the op's outcome to its rank, which runs again if it was blocked on it."""
        frame, op.held = op.held, None
        assert frame is not None
        state = self._ranks[op.rank]
        state.buffered -= sum(map(len, frame.buffers))
        if op.rank < len(self.traffic.delivered):  # what came from other ranks
            self.traffic.delivered[op.rank] += sum(map(len, frame.buffers)) - op.echoed
            if op.kind == OpName.RECV and op.event >= 0:
                self.traffic.handed[(op.rank, op.event)] = len(self.traffic.per_rank[op.rank])
        woken = state.blocked_on is op and state.running and state.local.measured
        # Its figures just before the write that wakes it (a reading, some 10 µs, in a timed
        # call only): what its threads ran while it waited is CPU, never time free later.
        figures = state.meter.read() if woken and state.meter is not None else None
        sent = self._send(op.rank, frame)
        if state.blocked_on is op:
            state.blocked_on = None
            if woken:
                self._release(op.rank, figures, sent)

    def _hold(self, state: RankState, op: Op, size: int) -> bool:
        """Keep ``size`` more bytes for ``state``'s rank; refuse ``op`` past the limit."""
        state.buffered += size
        if state.buffered <= self.limits.buffered_bytes:
            return True
        state.buffered -= size
        limit = self.limits.buffered_bytes >> 20
        self._fault(
            Fault.LIMIT,
            f"rank {state.rank}: the {op.describe()} would leave more than {limit} MiB of its "
            "messages waiting in the grader (sent but not yet received, or received but "
            "never waited for)",
        )
        self._refuse(op, f"more than {limit} MiB of messages waiting in the grader")
        return False

    # -- the call's budget ------------------------------------------------------------------------

    def _in_call(self) -> int:
        """The bytes the call keeps in the grader now: every rank's payloads held and kept in
        the record."""
        return sum(s.buffered + s.recorded for s in self._ranks[: self.active])

    def _within_budget(self, state: RankState, op: Op) -> None:
        """The call's budget (:attr:`Limits.call_bytes`), shared by its ranks, after
        ``state``'s rank posted ``op``: past its share (what it sent and what it received
        and has not waited for), the rank is at fault. The ranks run the same program, so
        none needs more than its share; and whatever each rank does, the call keeps no more
        than the budget."""
        share = self.limits.call_bytes // max(self.active, 1)
        if state.buffered + state.recorded <= share:
            return
        raise LimitExceeded(
            f"took the grader past its share of the call's budget ({share >> 20} of "
            f"{self.limits.call_bytes >> 20} MiB for {self.active} ranks) with the "
            f"{op.describe()} (its messages and collectives' inputs kept for the tests and "
            "held until received, together)"
        )

    def _affords(self, members: list[Op]) -> bool:
        """Whether the call's budget holds the results the collective of ``members`` would
        make; if not, it is refused to every member, each at fault."""
        made = collectives.produced(members)
        if self._in_call() + made <= self.limits.call_bytes:
            return True
        limit, first = self.limits.call_bytes >> 20, members[0]
        ranks = ", ".join(str(op.rank) for op in members)
        self._fault(
            Fault.LIMIT,
            f"ranks {ranks}: the {first.describe()} would make {made >> 20} MiB of results, "
            f"past the {limit} MiB the grader keeps for one call",
        )
        for op in members:
            self._ranks[op.rank].buffered -= sum(map(len, op.payload))
            op.payload = []
            self._refuse(op, f"its results would pass the {limit} MiB the grader keeps for a call")
        return False

    # -- faults ----------------------------------------------------------------------------------

    def _fault(self, kind: Fault, message: str) -> None:
        self.problems.append(Problem(kind, clean(message)))

    def _check_deadlock(self) -> None:
        message = faults.deadlock(self._ranks[: self.active])
        if message is not None:
            self._fault(Fault.DEADLOCK, message)
            for state in self._ranks[: self.active]:
                if state.blocked_on is not None:
                    self._refuse(state.blocked_on, "deadlock: no rank can make progress")

    def _finish(self, state: RankState, outcome: Returned | RankError) -> None:
        state.outcome = outcome
        state.running = False
        state.blocked_on = None
        if all(r.outcome is not None for r in self._ranks[: self.active]):
            self._ended()
        self._check_deadlock()

    def _ended(self) -> None:
        """Every rank's call is over: so is its local time, with a reading of each timed one
        (what a rank ran after its result, while the call went on, is its own)."""
        for state in self._ranks[: self.active]:
            if state.local.measured and state.meter is not None:
                state.local.ended(state.meter.read(), self._records(state.rank))

    def _check_leftovers(self) -> None:
        """At the end of a call: messages sent and never received, receives never matched."""
        if self._leftovers_checked:
            return
        self._leftovers_checked = True
        for op, message, reason in faults.leftovers(self._sends, self._recvs):
            self._fault(Fault.UNRECEIVED, message)
            self._refuse(op, reason)
        for message in faults.never_waited(self._ops.values()):
            self._fault(Fault.UNWAITED, message)

    def _reset_call(self) -> None:
        self.problems: list[Problem] = []
        self.traffic = Traffic.empty(self.active)
        self._sends: dict[tuple[int, int, int], deque[Op]] = defaultdict(deque)
        self._recvs: dict[tuple[int, int, int], deque[Op]] = defaultdict(deque)
        self._ops: dict[tuple[int, int], Op] = {}
        self._collectives: dict[tuple[tuple[int, ...], int], dict[int, Op]] = {}
        self._sequence: dict[tuple[int, tuple[int, ...]], int] = defaultdict(int)
        self._leftovers_checked = False
        for state in self._ranks:  # the last call's messages never handed over
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
