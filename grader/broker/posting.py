"""What each of a rank's operations does to the current call: a message, a collective, a gate,
a wait for an outcome, a mark, and the call's end (its result or its exception).

Each is checked against what it carries and against what the call keeps for the rank (the
limits of :class:`~grader.broker.ops.Limits`), put on the call's record
(:class:`~grader.broker.traffic.Traffic`) and handed to :class:`Matching`, which moves it
along. The broker (:class:`grader.broker.server.Broker`) calls these, under its lock.
"""

from __future__ import annotations

from grader import protocol
from grader.broker.matching import Matching
from grader.broker.ops import (
    CollectiveCall,
    LimitExceeded,
    Op,
    RankState,
    Returned,
    check_payload,
)
from grader.broker.traffic import Event, GatePass, Wait
from grader.failures import Fault
from grader.protocol import OpName, ProtocolError, RankError, clean, field_int
from grader.segment import settled
from grader.wire import Frame


class Posting:
    """The handlers of a rank's operation frames, one per frame type, on ``matching``'s call."""

    def __init__(self, matching: Matching) -> None:
        self.matching = matching
        self.limits = matching.limits

    def mark(self, state: RankState, frame: Frame) -> None:
        if state.running:
            state.count(self.limits)
            label = clean(frame.header.get("label", ""), 80)
            self.matching.traffic.per_rank[state.rank].append(Event(OpName.MARK, -1, 0, at=label))

    def send(self, state: RankState, frame: Frame) -> None:
        op = self.matching.new_op(state, frame, OpName.SEND)
        if len(frame.buffers) != 1 or op.meta is None:
            raise ProtocolError("a send carries exactly one tensor")
        check_payload(op.meta, frame.buffers[0], "a send")
        if self.matching.check_peer(op) and self.hold(state, op, len(frame.buffers[0])):
            if self.matching.keep_payloads:
                state.record(len(frame.buffers[0]), self.limits)
            self.within_budget(state, op)
            if self.matching.keep_payloads:
                frame = settled(frame)  # held as it was read, just before this call began
            op.payload = frame.buffers
            self.matching.queue(self.matching.sends, (op.rank, op.peer, op.tag), op)

    def recv(self, state: RankState, frame: Frame) -> None:
        op = self.matching.new_op(state, frame, OpName.RECV)
        if self.matching.check_peer(op):
            self.matching.queue(self.matching.recvs, (op.peer, op.rank, op.tag), op)

    def collective(self, state: RankState, frame: Frame) -> None:
        name = clean(frame.header.get("name", ""), 40)
        op = self.matching.new_op(state, frame, name)
        if self.matching.forbid_collectives:
            self.matching.fault(
                Fault.FORBIDDEN,
                f"rank {state.rank}: called a built-in collective ({name}) at {op.at or '?'}: "
                "built-in collectives are not allowed in this part; "
                "build it from send/recv/isend/irecv",
            )
            self.matching.refuse(op, "built-in collectives are not allowed in this part")
            return
        group = protocol.field_ranks(frame.header, self.matching.active)
        if state.rank not in group:
            raise ProtocolError("a rank posted a collective of a group it is not in")
        op.group, op.call = group, CollectiveCall.read(frame.header)
        if len(frame.buffers) != len(op.call.inputs):
            raise ProtocolError("a collective carries one payload per input tensor")
        for meta, buffer in zip(op.call.inputs, frame.buffers, strict=True):
            check_payload(meta, buffer, f"{name}'s input")
        op.payload = frame.buffers
        nbytes = sum(len(b) for b in op.payload)
        if not self.hold(state, op, nbytes):
            return
        inputs = op.call.inputs
        dtype = inputs[0].dtype if inputs else ""
        # As posted, with the dtype: a bucket flattened in float32 shows here, not only in bytes.
        op.event = len(self.matching.traffic.per_rank[state.rank])
        if self.matching.keep_payloads:
            state.record(nbytes, self.limits)
        self.within_budget(state, op)
        self.matching.traffic.per_rank[state.rank].append(
            Event(
                name,
                -1,
                nbytes,
                at=op.at,
                dtype=dtype,
                payload=b"".join(op.payload) if self.matching.keep_payloads else b"",
                pieces=tuple(map(len, op.payload)),
                root=source(name, op.call.root, group),
                group=group,
            )
        )
        sequence = self.matching.sequence[(state.rank, group)]
        self.matching.sequence[(state.rank, group)] += 1
        pending = self.matching.pending.setdefault((group, sequence), {})
        pending[state.rank] = op
        if len(pending) == len(group):
            del self.matching.pending[(group, sequence)]
            self.matching.run_collective([pending[r] for r in group])

    def gate(self, state: RankState, frame: Frame) -> None:
        op = self.matching.new_op(state, frame, protocol.GATE)
        label = clean(frame.header.get("label", ""), 80)
        if not state.gates or state.gates[0].label != label:
            raise ProtocolError(f"a gate {label!r} where the call has none")
        gate, events = state.gates.pop(0), self.matching.traffic.per_rank[state.rank]
        world = tuple(range(self.matching.active))
        opened = any(gate.opened_by(e, world) for e in events[state.gate_from :])
        self.matching.traffic.gates[state.rank].append(GatePass(label, opened, len(events)))
        state.gate_from = len(events)
        self.matching.complete(op, [gate.secret])

    def wait(self, state: RankState, frame: Frame) -> None:
        """The rank asks for an operation's outcome; ``block``: it waits until it comes."""
        op = self.matching.ops.get((state.rank, field_int(frame.header, "op", 0)))
        if op is None:
            return
        state.count(self.limits)
        if not op.waited:
            op.waited = True
            waits = self.matching.traffic.waits[state.rank]
            waits.append(Wait(len(self.matching.traffic.per_rank[state.rank]), op.event))
        if op.held is not None:
            self.matching.deliver(op)
        elif not op.done and frame.header.get("block", True) is not False:
            state.blocked_on = op
            self.matching.check_deadlock()

    def result(self, state: RankState, frame: Frame) -> None:
        self.matching.finish(state, Returned.read(frame.header, frame.buffers))

    def failure(self, state: RankState, frame: Frame) -> None:
        self.matching.finish(state, RankError.read(frame.header.get("error")))

    # -- what the call keeps -----------------------------------------------------------------

    def hold(self, state: RankState, op: Op, size: int) -> bool:
        """Keep ``size`` more bytes for ``state``'s rank; refuse ``op`` past the limit."""
        state.buffered += size
        if state.buffered <= self.limits.buffered_bytes:
            return True
        state.buffered -= size
        limit = self.limits.buffered_bytes >> 20
        self.matching.fault(
            Fault.LIMIT,
            f"rank {state.rank}: the {op.describe()} would leave more than {limit} MiB of its "
            "messages waiting in the grader (sent but not yet received, or received but "
            "never waited for)",
        )
        self.matching.refuse(op, f"more than {limit} MiB of messages waiting in the grader")
        return False

    def within_budget(self, state: RankState, op: Op) -> None:
        """The call's budget (:attr:`Limits.call_bytes`), shared by its ranks, after
        ``state``'s rank posted ``op``: past its share (what it sent and what it received
        and has not waited for), the rank is at fault. The ranks run the same program, so
        none needs more than its share; and whatever each rank does, the call keeps no more
        than the budget."""
        budget, active = self.limits.call_bytes, self.matching.active
        share = budget // max(active, 1)
        if state.buffered + state.recorded <= share:
            return
        raise LimitExceeded(
            f"took the grader past its share of the call's budget ({share >> 20} of "
            f"{budget >> 20} MiB for {active} ranks) with the "
            f"{op.describe()} (its messages and collectives' inputs kept for the tests and "
            "held until received, together)"
        )


def source(name: str, root: int, group: tuple[int, ...]) -> int:
    """The global rank a collective called ``name`` with group rank ``root`` broadcasts from;
    -1 if it is no broadcast, or its root is outside the group (the broker refuses it)."""
    return group[root] if name == OpName.BROADCAST and 0 <= root < len(group) else -1
