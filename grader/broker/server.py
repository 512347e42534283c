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

The broker holds three parts, each readable alone: the ranks' connections, one thread
reading each rank and another writing to it (:mod:`grader.broker.connections`); the
current call's state and the rules that match, compute and deliver its operations
(:mod:`grader.broker.matching`); and what each operation a rank posts does to the call
(:mod:`grader.broker.posting`). All state is guarded by the connections' one lock; the
broker's table names the handler of each message type of :mod:`grader.protocol`.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from grader import protocol, wire
from grader.broker.connections import Connections
from grader.broker.matching import Matching
from grader.broker.ops import Gate, LimitExceeded, Limits, Problem, RankState, Returned
from grader.broker.posting import Posting
from grader.broker.traffic import Traffic
from grader.failures import Fault
from grader.protocol import ProtocolError, RankError, RankExit, clean
from grader.wire import Frame

Handler = Callable[[RankState, Frame], None]


class Broker:
    """The parts it holds, each readable alone: the ranks' ``connections``, the current call's
    ``matching``, and ``posting``, what each operation a rank posts does to that call."""

    def __init__(self, world_size: int, limits: Limits | None = None) -> None:
        limits = limits or Limits()
        self.connections = Connections(world_size, limits.frame_bytes, self)
        self.matching = Matching(self.connections, limits)
        self.posting = Posting(self.matching)
        self.exits: dict[int, RankExit] = {}  # what the relays of ranks on other nodes said
        self._cv, self._ranks = self.connections.cv, self.connections.ranks
        posting = self.posting
        self._handlers: dict[str, Handler] = {
            protocol.HELLO: self._hello,
            protocol.SEGMENT: self._segment,
            protocol.IMPORTING: self._importing,
            protocol.IMPORTED: self._imported,
            protocol.STACK: self._stack,
            protocol.MARK: posting.mark,
            protocol.SEND: posting.send,
            protocol.RECV: posting.recv,
            protocol.COLLECTIVE: posting.collective,
            protocol.GATE: posting.gate,
            protocol.WAIT: posting.wait,
            protocol.RESULT: posting.result,
            protocol.FAILURE: posting.failure,
        }

    # -- the connections' and the call's, as the grader reads them ---------------------------

    @property
    def traffic(self) -> Traffic:
        return self.matching.traffic

    @property
    def problems(self) -> list[Problem]:
        return self.matching.problems

    @property
    def ended(self) -> str | None:
        return self.connections.ended

    def accept_on(self, listeners: list[socket.socket]) -> None:
        self.connections.accept_on(listeners)

    def serve(self, rank: int, sock: socket.socket, relayed: bool = False) -> None:
        self.connections.serve(rank, sock, relayed)

    def end_job(self, why: str) -> None:
        self.connections.end_job(why)

    def dead(self) -> list[int]:
        return self.connections.dead()

    def close(self) -> None:
        self.connections.close()

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
        call, connections = self.matching, self.connections
        with self._cv:
            call.active = len(frames)
            call.reset_call()
            call.forbid_collectives = forbid_collectives
            call.keep_payloads = keep_payloads
            for state, frame in zip(self._ranks, frames, strict=False):
                state.start_call(gates[state.rank] if gates else [], timed)
                # Its figures before it has the call, free once it has: what it runs as soon
                # as the frame arrives counts, however late this thread gets a CPU again.
                before = state.meter.read() if state.meter and state.local.measured else None
                connections.release(state.rank, before, connections.send(state.rank, frame))
            call.traffic.local = [state.local for state in self._ranks[: call.active]]

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
                if all(r.outcome is not None for r in self._ranks[: self.matching.active]):
                    self.matching.check_leftovers()
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
            return [r.outcome for r in self._ranks[: self.matching.active]]

    def still_running(self) -> list[int]:
        with self._cv:
            return [
                r.rank for r in self._ranks[: self.matching.active] if r.alive and r.outcome is None
            ]

    def importing(self) -> dict[int, str]:
        with self._cv:
            return {r.rank: r.importing for r in self._ranks if r.importing}

    def stacks(self, ranks: list[int], timeout: float = 1.0) -> dict[int, list[str]]:
        """Ask ``ranks`` where they are (their student frames); whatever arrives in time."""
        deadline = time.monotonic() + timeout
        with self._cv:
            for rank in ranks:
                self._ranks[rank].stack = None
                self.connections.send(rank, Frame({"type": protocol.DUMP_STACK}))
            while any(self._ranks[r].stack is None and self._ranks[r].alive for r in ranks):
                if not self._cv.wait(max(0.0, deadline - time.monotonic())):
                    break
            return {r: list(self._ranks[r].stack or []) for r in ranks}

    def unread(self, ranks: list[int], timeout: float = 1.0) -> set[int]:
        """Those of ``ranks`` that what the broker sends them still waits for (being written,
        or queued) after up to ``timeout`` seconds: they stopped reading."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while busy := {r for r in ranks if self.connections.outboxes[r].busy}:
                if not self._cv.wait(max(0.0, deadline - time.monotonic())):
                    break
            return busy

    def blocked(self) -> dict[int, str]:
        """What each blocked rank waits in, e.g. "send to rank 1 at assignments/...:31"."""
        with self._cv:
            return {r.rank: r.blocked_on.describe() for r in self._ranks if r.blocked_on}

    # -- what the connections hand over (:class:`grader.broker.connections.Reader`) ----------

    def holds(self, frame: Frame) -> bool:
        return self.matching.holds(frame)

    def records(self, rank: int) -> tuple[int, int]:
        return self.matching.records(rank)

    def broke(self, rank: int, error: str) -> None:
        self.matching.fault(Fault.PROTOCOL, f"rank {rank} broke the protocol: {error}")

    def relay_said(self, rank: int, frame: Frame) -> None:
        if frame.header["type"] == protocol.EXITED:
            self.exits[rank] = RankExit.read(frame.header)
        else:
            error = clean(frame.header.get("error", ""), 300)
            self.matching.fault(Fault.PROTOCOL, f"rank {rank} broke the protocol: {error}")

    def handle(self, rank: int, frame: Frame, unreadable: wire.WireError | None) -> None:
        state = self._ranks[rank]
        if state.broken:
            return  # nothing a rank says after breaking the protocol counts in this call
        handler = self._handlers.get(frame.header["type"])
        try:
            if unreadable is not None:
                raise unreadable
            if handler is None:
                raise ProtocolError(f"unknown message {clean(frame.header['type'], 40)!r}")
            handler(state, frame)
        except LimitExceeded as err:
            message = f"rank {rank} {err}"
            self.matching.fault(Fault.LIMIT, message)
        except (ProtocolError, wire.WireError, KeyError, TypeError, ValueError) as err:
            message = f"rank {rank} broke the protocol: {err}"
            self.matching.fault(Fault.PROTOCOL, message)
        else:
            return
        if state.running:  # its call is over: the broker no longer listens to it
            state.broken = True
            self.matching.finish(state, RankError(protocol.REFUSED_ERROR, clean(message)))

    # -- what a rank says of itself, outside its call's operations (:class:`Posting`'s) -------

    def _hello(self, state: RankState, frame: Frame) -> None:
        state.up = True

    def _segment(self, state: RankState, frame: Frame) -> None:
        """The rank mapped the segment it was given: the broker's answers may use it now."""
        if state.segment is None:
            raise ProtocolError("a shared segment it was never given")
        state.segment.mapped = True

    def _importing(self, state: RankState, frame: Frame) -> None:
        state.importing = clean(frame.header.get("module", ""), 80)

    def _imported(self, state: RankState, frame: Frame) -> None:
        state.importing = ""

    def _stack(self, state: RankState, frame: Frame) -> None:
        raw = frame.header.get("frames")
        state.stack = [clean(f, 300) for f in raw[:30]] if isinstance(raw, list) else []
