"""The broker: the trusted end of every rank's connection, and the only path between ranks.

Each rank connects to a Unix socket of its own (bound into its sandbox
alone, so a rank is who its socket says), or, on another node, through a
trusted relay that proved it knows the course's secret
(:mod:`grader.launch.nodes`). Sends and receives are matched
here, in order per (source, destination, tag), as MPI and gloo match them;
collectives are computed here from every member's contribution. Because the
broker sees every operation and knows which ranks are blocked, it sees
faults exactly and at once, with no timeout:

- a deadlock: no rank is running and some rank is blocked;
- a send and its receive that disagree on size or dtype;
- a message to a rank outside the group;
- a collective where the part forbids them, or one the ranks disagree on;
- a message sent and never received, at the end of a call.

One thread reads each rank; all state is guarded by one lock. Handlers are
``rank_<type>`` methods, one per message type of :mod:`grader.protocol`.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grader import protocol, wire
from grader.broker import collectives, faults
from grader.broker.ops import (
    Op,
    Problem,
    RankState,
    Returned,
    nbytes,
)
from grader.broker.traffic import Event, Traffic
from grader.protocol import ProtocolError, RankError, RankExit, TensorMeta, clean, field_int
from grader.wire import Frame


class Broker:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._cv = threading.Condition()
        self._ranks = [RankState(r) for r in range(world_size)]
        self._listeners: list[socket.socket] = []
        self.exits: dict[int, RankExit] = {}  # what the relays of ranks on other nodes said
        self.active = world_size  # the ranks of the current call: 0..active-1
        self._reset_call()
        self.forbid_collectives = False

    def listen_unix(self, socket_dir: Path) -> None:
        """One Unix socket per rank in ``socket_dir``: the ranks of this machine."""
        for rank in range(self.world_size):
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(self.socket_path(socket_dir, rank)))
            listener.listen(1)
            self._listeners.append(listener)
            threading.Thread(target=self._accept, args=(rank, listener), daemon=True).start()

    @staticmethod
    def socket_path(socket_dir: Path, rank: int) -> Path:
        return socket_dir / f"rank{rank}.sock"

    # -- what the grader asks --------------------------------------------------------------

    def connected(self) -> list[int]:
        with self._cv:
            return [r.rank for r in self._ranks if r.sock is not None and r.alive]

    def dead(self) -> list[int]:
        with self._cv:
            return [r.rank for r in self._ranks if not r.alive]

    def start_call(self, frames: list[Frame], forbid_collectives: bool) -> None:
        """Send rank r ``frames[r]``: the call runs on the first ``len(frames)`` ranks."""
        with self._cv:
            self.active = len(frames)
            self._reset_call()
            self.forbid_collectives = forbid_collectives
            for state, frame in zip(self._ranks, frames, strict=False):
                state.running, state.outcome, state.stack = True, None, None
                self._send(state.rank, frame)

    def wait_call(self, deadline: float, alive: Callable[[], bool]) -> bool:
        """Wait until every rank returned, a rank died, or the deadline; True if all returned."""
        with self._cv:
            while True:
                if all(r.outcome is not None for r in self._ranks[: self.active]):
                    self._check_leftovers()
                    return True
                if any(not r.alive for r in self._ranks) or not alive():
                    return False
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cv.wait(min(remaining, 0.1))

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

    def blocked(self) -> dict[int, str]:
        """What each blocked rank waits in, e.g. "send to rank 1 at assignments/...:31"."""
        with self._cv:
            return {r.rank: r.blocked_on.describe() for r in self._ranks if r.blocked_on}

    def close(self) -> None:
        with self._cv:
            for state in self._ranks:
                if state.sock is not None:
                    with contextlib.suppress(OSError):
                        state.sock.shutdown(socket.SHUT_RDWR)
                    state.sock.close()
            for listener in self._listeners:
                listener.close()

    # -- connections -------------------------------------------------------------------------

    def _accept(self, rank: int, listener: socket.socket) -> None:
        try:
            sock, _ = listener.accept()
        except OSError:
            return
        listener.close()  # one connection per rank: a second one is never accepted
        self.serve(rank, sock)

    def serve(self, rank: int, sock: socket.socket, relayed: bool = False) -> None:
        """Read rank ``rank``'s connection until it ends (on the caller's thread).

        ``relayed``: the connection comes from the rank's trusted relay on another
        node, which may add what only it knows (:data:`protocol.RELAY_ONLY`).
        """
        with self._cv:
            if self._ranks[rank].sock is not None:  # one connection per rank
                sock.close()
                return
            self._ranks[rank].sock = sock
            self._cv.notify_all()
        try:
            while (frame := wire.recv_frame(sock)) is not None:
                with self._cv:
                    if relayed and frame.header["type"] in protocol.RELAY_ONLY:
                        self._relay_said(rank, frame)
                    else:
                        self._handle(rank, frame)
                    self._cv.notify_all()
        except (OSError, wire.WireError) as err:
            if not isinstance(err, OSError):
                with self._cv:
                    self._fault(
                        protocol.ERROR, "protocol", f"rank {rank} broke the protocol: {err}"
                    )
        with self._cv:
            self._ranks[rank].alive = False
            self._cv.notify_all()

    def _relay_said(self, rank: int, frame: Frame) -> None:
        if frame.header["type"] == protocol.EXITED:
            self.exits[rank] = RankExit.read(frame.header)
        else:
            error = clean(frame.header.get("error", ""), 300)
            self._fault(protocol.ERROR, "protocol", f"rank {rank} broke the protocol: {error}")

    def _handle(self, rank: int, frame: Frame) -> None:
        handler = getattr(self, f"rank_{frame.header['type']}", None)
        try:
            if handler is None:
                raise ProtocolError(f"unknown message {clean(frame.header['type'], 40)!r}")
            handler(self._ranks[rank], frame)
        except (ProtocolError, wire.WireError, KeyError, TypeError, ValueError) as err:
            self._fault(protocol.ERROR, "protocol", f"rank {rank} broke the protocol: {err}")

    def _send(self, rank: int, frame: Frame) -> None:
        sock = self._ranks[rank].sock
        if sock is not None and self._ranks[rank].alive:
            try:
                wire.send_frame(sock, frame)
            except OSError:
                self._ranks[rank].alive = False

    # -- what a rank sends, one method per message -------------------------------------------

    def rank_hello(self, state: RankState, frame: Frame) -> None:
        pass

    def rank_importing(self, state: RankState, frame: Frame) -> None:
        state.importing = clean(frame.header.get("module", ""), 80)

    def rank_imported(self, state: RankState, frame: Frame) -> None:
        state.importing = ""

    def rank_stack(self, state: RankState, frame: Frame) -> None:
        raw = frame.header.get("frames")
        state.stack = [clean(f, 300) for f in raw[:30]] if isinstance(raw, list) else []

    def rank_mark(self, state: RankState, frame: Frame) -> None:
        if state.running:
            label = clean(frame.header.get("label", ""), 80)
            self.traffic.per_rank[state.rank].append(Event("mark", -1, 0, at=label))

    def rank_send(self, state: RankState, frame: Frame) -> None:
        op = self._op(state, frame, "send")
        if len(frame.buffers) != 1 or op.meta is None:
            raise ProtocolError("a send carries exactly one tensor")
        op.payload = frame.buffers
        if self._check_peer(op):
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
                protocol.FORBIDDEN,
                "forbidden",
                f"rank {state.rank}: called a built-in collective ({name}) at {op.at or '?'}: "
                "built-in collectives are not allowed in this part; "
                "build it from send/recv/isend/irecv",
            )
            self._refuse(op, "built-in collectives are not allowed in this part")
            return
        group = protocol.field_ranks(frame.header, self.active)
        if state.rank not in group:
            raise ProtocolError("a rank posted a collective of a group it is not in")
        op.info = {
            "group": group,
            "root": frame.header.get("root", 0),
            "reduce_op": clean(frame.header.get("reduce_op", "sum"), 20),
            "inputs": [TensorMeta.read(m) for m in frame.header.get("inputs", [])],
            "outputs": [TensorMeta.read(m) for m in frame.header.get("outputs", [])],
        }
        op.payload = frame.buffers
        nbytes = sum(len(b) for b in op.payload)
        inputs = op.info["inputs"]
        dtype = inputs[0].dtype if inputs else ""
        # As posted, with the dtype: a bucket flattened in float32 shows here, not only in bytes.
        self.traffic.per_rank[state.rank].append(
            Event(name, -1, nbytes, at=op.at, dtype=dtype, payload=b"".join(op.payload))
        )
        sequence = self._sequence[(state.rank, group)]
        self._sequence[(state.rank, group)] += 1
        pending = self._collectives.setdefault((group, sequence), {})
        pending[state.rank] = op
        if len(pending) == len(group):
            del self._collectives[(group, sequence)]
            self._run_collective([pending[r] for r in group])

    def rank_wait(self, state: RankState, frame: Frame) -> None:
        op = self._ops.get((state.rank, field_int(frame.header, "op", 0)))
        if op is not None and not op.done:
            state.blocked_on = op
            self._check_deadlock()

    def rank_result(self, state: RankState, frame: Frame) -> None:
        value = wire.decode(frame.header.get("value"), frame.buffers)
        rebound = frame.header.get("rebound")
        rebound = tuple(clean(r, 60) for r in rebound[:50]) if isinstance(rebound, list) else ()
        self._finish(state, Returned(value, rebound))

    def rank_failure(self, state: RankState, frame: Frame) -> None:
        self._finish(state, RankError.read(frame.header.get("error")))

    # -- matching ------------------------------------------------------------------------------

    def _op(self, state: RankState, frame: Frame, kind: str) -> Op:
        if not state.running:
            raise ProtocolError("an operation outside of any call")
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
        if kind in ("send", "recv"):
            group = protocol.field_ranks(header, self.active)
            peer = field_int(header, "peer")
            op.peer = group[peer] if 0 <= peer < len(group) else -2 - peer
            op.info = {"group": group, "group_peer": peer}
        return op

    def _check_peer(self, op: Op) -> bool:
        group = op.info["group"]
        if op.peer >= 0 and op.peer != op.rank:
            return True
        peer = op.info["group_peer"]
        direction = "to" if op.kind == "send" else "from"
        reason = (
            "itself"
            if op.peer == op.rank
            else f"rank {peer}, but the group has ranks 0..{len(group) - 1}"
        )
        self._fault(
            protocol.ERROR,
            "bad_peer",
            f"rank {op.rank}: {op.kind} {direction} {reason} (at {op.at or '?'})",
        )
        self._refuse(op, f"{op.kind} {direction} {reason}")
        return False

    def _queue(self, queues: dict[tuple[int, int, int], deque[Op]], key: Any, op: Op) -> None:
        queues[key].append(op)
        self.traffic.per_rank[op.rank].append(
            Event(
                op.kind,
                op.peer,
                nbytes(op.meta) if op.meta else 0,
                op.tag,
                payload=op.payload[0] if op.payload else b"",
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
                protocol.ERROR,
                "mismatch",
                f"rank {send.rank} sent {size} bytes ({send.meta}) to rank {recv.rank} "
                f"(at {send.at or '?'}), which posted a receive of {expected} bytes "
                f"({recv.meta}) (at {recv.at or '?'})",
            )
            self._refuse(send, "the receive posted for this message has another size or dtype")
            self._refuse(recv, "the message sent here has another size or dtype")
            return
        self._complete(recv, send.payload)
        self._complete(send, [])

    def _run_collective(self, members: list[Op]) -> None:
        try:
            outputs = collectives.run(members)
        except collectives.CollectiveError as err:
            self._fault(protocol.ERROR, "disagreement", str(err))
            for member in members:
                self._refuse(member, str(err))
            return
        for op, tensors in zip(members, outputs, strict=True):
            self._complete(op, [wire.tensor_buffer(t) for t in tensors])

    def _complete(self, op: Op, buffers: list[bytes]) -> None:
        self._answer(op, Frame({"type": protocol.DONE, "op": op.id}, buffers))

    def _refuse(self, op: Op, message: str) -> None:
        self._answer(op, Frame({"type": protocol.REFUSED, "op": op.id, "message": message}))

    def _answer(self, op: Op, frame: Frame) -> None:
        """The op is over, and its rank, if it was blocked on it, runs again."""
        op.done = True
        state = self._ranks[op.rank]
        if state.blocked_on is op:
            state.blocked_on = None
        self._send(op.rank, frame)

    # -- faults ----------------------------------------------------------------------------------

    def _fault(self, outcome: str, kind: str, message: str) -> None:
        self.problems.append(Problem(outcome, clean(message), kind))

    def _check_deadlock(self) -> None:
        message = faults.deadlock(self._ranks[: self.active])
        if message is not None:
            self._fault(protocol.TIMEOUT, "deadlock", message)
            for state in self._ranks[: self.active]:
                if state.blocked_on is not None:
                    self._refuse(state.blocked_on, "deadlock: no rank can make progress")

    def _finish(self, state: RankState, outcome: Returned | RankError) -> None:
        state.outcome = outcome
        state.running = False
        state.blocked_on = None
        self._check_deadlock()

    def _check_leftovers(self) -> None:
        """At the end of a call: messages sent and never received, receives never matched."""
        if self._leftovers_checked:
            return
        self._leftovers_checked = True
        for op, message, reason in faults.leftovers(self._sends, self._recvs):
            self._fault(protocol.ERROR, "unreceived", message)
            self._refuse(op, reason)

    def _reset_call(self) -> None:
        self.problems: list[Problem] = []
        self.traffic = Traffic.empty(self.active)
        self._sends: dict[tuple[int, int, int], deque[Op]] = defaultdict(deque)
        self._recvs: dict[tuple[int, int, int], deque[Op]] = defaultdict(deque)
        self._ops: dict[tuple[int, int], Op] = {}
        self._collectives: dict[tuple[tuple[int, ...], int], dict[int, Op]] = {}
        self._sequence: dict[tuple[int, tuple[int, ...]], int] = defaultdict(int)
        self._leftovers_checked = False
