"""The broker: the trusted end of every rank's connection, and the only path between ranks.

Each rank connects to a Unix socket of its own (bound into its sandbox
alone, so a rank is who its socket says), or, on another node, through a
trusted relay that proved it knows the course's secret
(:mod:`grader.nodes`). Sends and receives are matched
here, in order per (source, destination, tag), as MPI and gloo match them;
collectives are computed here from every member's contribution. Because the
broker sees every operation and knows which ranks are blocked, it sees
faults exactly and at once, with no timeout:

- a deadlock: no rank is running and some rank is blocked;
- a send and its receive that disagree on size or dtype;
- a message to a rank outside the group;
- a collective where the part forbids them, or one the ranks disagree on;
- a collective whose arguments gloo refuses (:mod:`grader.broker.rules`);
- a message sent and never received, or a request never waited, at the end of a call;
- a rank that costs the trusted side more than :class:`~grader.broker.ops.Limits` allows.

A frame is checked against what it carries (a payload of exactly the bytes its
description says; payloads a frame names in the rank's shared segment are first copied
into the broker's memory, :mod:`grader.segment`, and only that copy is used), and a
received message or a collective's result is handed to its rank only once the rank
waits for it (``wait``, ``is_completed``, ``get_future``): the waits the broker records
are then the points after which a rank can have used what it received, which is what
the replays of :mod:`grader.judge.replay` rest on.

One thread reads each rank and another writes to it (:mod:`grader.broker.connections`);
all state is guarded by one lock. Handlers are
``rank_<type>`` methods, one per message type of :mod:`grader.protocol`; the rules that
match, compute and deliver a call's operations are :mod:`grader.broker.matching`'s.
"""

from __future__ import annotations

import time

from grader import protocol, wire
from grader.broker import memory
from grader.broker.matching import Matching
from grader.broker.ops import (
    CollectiveCall,
    Gate,
    LimitExceeded,
    Limits,
    RankState,
    Returned,
    check_payload,
)
from grader.broker.traffic import Event, GatePass, Wait
from grader.failures import Fault
from grader.protocol import ProtocolError, RankError, RankExit, clean, field_int
from grader.segment import SEGMENT_BYTES, settled
from grader.wire import Frame


class Broker(Matching):
    def __init__(self, world_size: int, limits: Limits | None = None) -> None:
        super().__init__(world_size, limits or Limits())
        self.exits: dict[int, RankExit] = {}  # what the relays of ranks on other nodes said
        self.forbid_collectives = False

    # -- what the grader asks --------------------------------------------------------------

    def broken(self) -> list[int]:
        """The ranks whose call the broker ended (a broken protocol, a limit passed): what they
        run now is no call's, so their job must not serve another."""
        with self._cv:
            return [r.rank for r in self._ranks if r.broken]

    def start_call(
        self,
        frames: list[Frame],
        forbid_collectives: bool,
        gates: list[list[Gate]] | None = None,
        keep_payloads: bool = True,
        timed: bool = False,
    ) -> None:
        """Send rank r ``frames[r]``: the call runs on the first ``len(frames)`` ranks, rank r's
        scenario passing ``gates[r]`` in order (:class:`~grader.broker.ops.Gate`).
        ``keep_payloads``: the call's record keeps what every message and collective carried,
        for the tests that read it; without it, a payload lives only until it is delivered.
        ``timed``: each rank's local time is measured, from the kernel's figures read at its
        every frame (the performance tests'); other calls read none."""
        with self._cv:
            self.active = len(frames)
            self._reset_call()
            self.forbid_collectives = forbid_collectives
            self.keep_payloads = keep_payloads
            for state, frame in zip(self._ranks, frames, strict=False):
                state.start_call(gates[state.rank] if gates else [], timed)
                # Its figures before it has the call, free once it has: what it runs as soon
                # as the frame arrives counts, however late this thread gets a CPU again.
                before = state.meter.read() if state.meter and state.local.measured else None
                self._release(state.rank, before, self._send(state.rank, frame))
            self.traffic.local = [state.local for state in self._ranks[: self.active]]

    def wait_connected(self, deadline: float) -> bool:
        """Wait until every rank is up: connected, and spoken (True); or a rank died, the job
        ended, or the deadline passed."""
        with self._cv:
            while not self._stopped():
                if all(r.up for r in self._ranks):
                    return True
                if not self._cv.wait(max(0.0, deadline - time.monotonic())):
                    return False
            return False

    def wait_call(self, deadline: float) -> bool:
        """Wait until every rank returned, a rank died, the job ended, or the deadline; True
        if all returned."""
        with self._cv:
            while True:
                if all(r.outcome is not None for r in self._ranks[: self.active]):
                    self._check_leftovers()
                    return True
                if self._stopped() or not self._cv.wait(max(0.0, deadline - time.monotonic())):
                    return False

    def wait_ended(self, ranks: list[int], deadline: float) -> None:
        """Wait until the end of each of ``ranks`` is on record (its relay said how it ended,
        or the job ended, and with it every rank's wrapper), or the deadline."""
        with self._cv:
            while self.ended is None and not all(r in self.exits for r in ranks):
                if not self._cv.wait(max(0.0, deadline - time.monotonic())):
                    return

    def _stopped(self) -> bool:
        return self.ended is not None or any(not r.alive for r in self._ranks)

    def outcomes(self) -> list[Returned | RankError | None]:
        with self._cv:
            return [r.outcome for r in self._ranks[: self.active]]

    def still_running(self) -> list[int]:
        with self._cv:
            return [r.rank for r in self._ranks[: self.active] if r.alive and r.outcome is None]

    def importing(self) -> dict[int, str]:
        with self._cv:
            return {r.rank: r.importing for r in self._ranks if r.importing}

    def stacks(self, ranks: list[int], timeout: float = 1.0) -> dict[int, list[str]]:
        """Ask ``ranks`` where they are (their student frames); whatever arrives in time."""
        deadline = time.monotonic() + timeout
        with self._cv:
            for rank in ranks:
                self._ranks[rank].stack = None
                self._send(rank, Frame({"type": protocol.DUMP_STACK}))
            while any(self._ranks[r].stack is None and self._ranks[r].alive for r in ranks):
                if not self._cv.wait(max(0.0, deadline - time.monotonic())):
                    break
            return {r: list(self._ranks[r].stack or []) for r in ranks}

    def unread(self, ranks: list[int], timeout: float = 1.0) -> set[int]:
        """Those of ``ranks`` that what the broker sends them still waits for (being written,
        or queued) after up to ``timeout`` seconds: they stopped reading."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while busy := {r for r in ranks if self._outboxes[r].busy}:
                if not self._cv.wait(max(0.0, deadline - time.monotonic())):
                    break
            return busy

    def blocked(self) -> dict[int, str]:
        """What each blocked rank waits in, e.g. "send to rank 1 at assignments/...:31"."""
        with self._cv:
            return {r.rank: r.blocked_on.describe() for r in self._ranks if r.blocked_on}

    def _broke(self, rank: int, error: str) -> None:
        self._fault(Fault.PROTOCOL, f"rank {rank} broke the protocol: {error}")

    def _relay_said(self, rank: int, frame: Frame) -> None:
        if frame.header["type"] == protocol.EXITED:
            self.exits[rank] = RankExit.read(frame.header)
        else:
            error = clean(frame.header.get("error", ""), 300)
            self._fault(Fault.PROTOCOL, f"rank {rank} broke the protocol: {error}")

    def _handle(self, rank: int, frame: Frame, unreadable: wire.WireError | None) -> None:
        state = self._ranks[rank]
        if state.broken:
            return  # nothing a rank says after breaking the protocol counts in this call
        handler = getattr(self, f"rank_{frame.header['type']}", None)
        try:
            if unreadable is not None:
                raise unreadable
            if handler is None:
                raise ProtocolError(f"unknown message {clean(frame.header['type'], 40)!r}")
            handler(state, frame)
        except LimitExceeded as err:
            message = f"rank {rank} {err}"
            self._fault(Fault.LIMIT, message)
        except (ProtocolError, wire.WireError, KeyError, TypeError, ValueError) as err:
            message = f"rank {rank} broke the protocol: {err}"
            self._fault(Fault.PROTOCOL, message)
        else:
            return
        if state.running:  # its call is over: the broker no longer listens to it
            state.broken = True
            self._finish(state, RankError(protocol.REFUSED_ERROR, clean(message)))

    # -- what a rank sends, one method per message -------------------------------------------

    def rank_hello(self, state: RankState, frame: Frame) -> None:
        state.up = True

    def rank_segment(self, state: RankState, frame: Frame) -> None:
        """The rank mapped the segment it was given: the broker's answers may use it now."""
        if state.segment is None:
            raise ProtocolError("a shared segment it was never given")
        state.segment.mapped = True

    def rank_importing(self, state: RankState, frame: Frame) -> None:
        state.importing = clean(frame.header.get("module", ""), 80)

    def rank_imported(self, state: RankState, frame: Frame) -> None:
        state.importing = ""

    def rank_stack(self, state: RankState, frame: Frame) -> None:
        raw = frame.header.get("frames")
        state.stack = [clean(f, 300) for f in raw[:30]] if isinstance(raw, list) else []

    def rank_mark(self, state: RankState, frame: Frame) -> None:
        if state.running:
            state.count(self.limits)
            label = clean(frame.header.get("label", ""), 80)
            self.traffic.per_rank[state.rank].append(Event("mark", -1, 0, at=label))

    def rank_send(self, state: RankState, frame: Frame) -> None:
        op = self._op(state, frame, "send")
        if len(frame.buffers) != 1 or op.meta is None:
            raise ProtocolError("a send carries exactly one tensor")
        check_payload(op.meta, frame.buffers[0], "a send")
        if self._check_peer(op) and self._hold(state, op, len(frame.buffers[0])):
            if self.keep_payloads:
                state.record(len(frame.buffers[0]), self.limits)
            self._within_budget(state, op)
            if self.keep_payloads:
                frame = settled(frame)  # held as it was read, just before this call began
            op.payload = frame.buffers
            self._queue(self._sends, (op.rank, op.peer, op.tag), op)

    def rank_recv(self, state: RankState, frame: Frame) -> None:
        op = self._op(state, frame, "recv")
        if self._check_peer(op):
            self._queue(self._recvs, (op.peer, op.rank, op.tag), op)

    def rank_collective(self, state: RankState, frame: Frame) -> None:
        name = clean(frame.header.get("name", ""), 40)
        op = self._op(state, frame, name)
        if self.forbid_collectives:
            self._fault(
                Fault.FORBIDDEN,
                f"rank {state.rank}: called a built-in collective ({name}) at {op.at or '?'}: "
                "built-in collectives are not allowed in this part; "
                "build it from send/recv/isend/irecv",
            )
            self._refuse(op, "built-in collectives are not allowed in this part")
            return
        group = protocol.field_ranks(frame.header, self.active)
        if state.rank not in group:
            raise ProtocolError("a rank posted a collective of a group it is not in")
        op.group, op.call = group, CollectiveCall.read(frame.header)
        if len(frame.buffers) != len(op.call.inputs):
            raise ProtocolError("a collective carries one payload per input tensor")
        for meta, buffer in zip(op.call.inputs, frame.buffers, strict=True):
            check_payload(meta, buffer, f"{name}'s input")
        op.payload = frame.buffers
        nbytes = sum(len(b) for b in op.payload)
        if not self._hold(state, op, nbytes):
            return
        inputs = op.call.inputs
        dtype = inputs[0].dtype if inputs else ""
        # As posted, with the dtype: a bucket flattened in float32 shows here, not only in bytes.
        op.event = len(self.traffic.per_rank[state.rank])
        if self.keep_payloads:
            state.record(nbytes, self.limits)
        self._within_budget(state, op)
        self.traffic.per_rank[state.rank].append(
            Event(
                name,
                -1,
                nbytes,
                at=op.at,
                dtype=dtype,
                payload=b"".join(op.payload) if self.keep_payloads else b"",
                pieces=tuple(map(len, op.payload)),
                root=source(name, op.call.root, group),
                group=group,
            )
        )
        sequence = self._sequence[(state.rank, group)]
        self._sequence[(state.rank, group)] += 1
        pending = self._collectives.setdefault((group, sequence), {})
        pending[state.rank] = op
        if len(pending) == len(group):
            del self._collectives[(group, sequence)]
            self._run_collective([pending[r] for r in group])

    def rank_gate(self, state: RankState, frame: Frame) -> None:
        op = self._op(state, frame, protocol.GATE)
        label = clean(frame.header.get("label", ""), 80)
        if not state.gates or state.gates[0].label != label:
            raise ProtocolError(f"a gate {label!r} where the call has none")
        gate, events = state.gates.pop(0), self.traffic.per_rank[state.rank]
        world = tuple(range(self.active))
        opened = any(gate.opened_by(e, world) for e in events[state.gate_from :])
        resident = _resident(state) if gate.measure else None
        self.traffic.gates[state.rank].append(GatePass(label, opened, len(events), resident))
        state.gate_from = len(events)
        self._complete(op, [gate.secret])

    def rank_wait(self, state: RankState, frame: Frame) -> None:
        """The rank asks for an operation's outcome; ``block``: it waits until it comes."""
        op = self._ops.get((state.rank, field_int(frame.header, "op", 0)))
        if op is None:
            return
        state.count(self.limits)
        if not op.waited:
            op.waited = True
            waits = self.traffic.waits[state.rank]
            waits.append(Wait(len(self.traffic.per_rank[state.rank]), op.event))
        if op.held is not None:
            self._deliver(op)
        elif not op.done and frame.header.get("block", True) is not False:
            state.blocked_on = op
            self._check_deadlock()

    def rank_result(self, state: RankState, frame: Frame) -> None:
        self._finish(state, Returned.read(frame.header, frame.buffers))

    def rank_failure(self, state: RankState, frame: Frame) -> None:
        self._finish(state, RankError.read(frame.header.get("error")))


def source(name: str, root: int, group: tuple[int, ...]) -> int:
    """The global rank a collective called ``name`` with group rank ``root`` broadcasts from;
    -1 if it is no broadcast, or its root is outside the group (the broker refuses it)."""
    return group[root] if name == "broadcast" and 0 <= root < len(group) else -1


def _resident(state: RankState) -> int | None:
    """The rank's resident memory now, by the pid the kernel gave (None: reached by a relay)."""
    pid = state.meter.pid if state.meter is not None else None
    return memory.resident(pid, SEGMENT_BYTES if state.segment is not None else 0)
