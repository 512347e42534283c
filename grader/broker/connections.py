"""The broker's end of every rank's connection: one reader thread a rank, one lock for all.

A rank is who its socket says: each has a Unix socket of its own, bound into
its sandbox alone, which accepts one connection; a rank on another node
reaches :meth:`Connections.serve` through its trusted relay. Every frame read
is handed, under the lock, to the broker's rules (:class:`grader.broker.server.Broker`).
A rank of this machine gets its shared-memory segment (:mod:`grader.segment`) in the
first frame on its connection; what the broker sends it goes through the segment when
it fits there. A relayed rank gets none.

What the broker's rules answer a rank is sent in order by :meth:`Connections.send`,
under the lock, but never waiting on the rank there: its payloads go into the rank's
segment, and the frame goes at once if the socket takes it whole; anything else is
queued for the rank's own writer thread. A rank that stops reading blocks its writer
alone. A rank waits on the broker from the moment a frame of its own has arrived whole
(its clocks are read then, in a timed call), and is free again (its local time runs,
:mod:`grader.broker.accounting`) from the moment the last write of what it was sent began:
the earliest it could have had it all (after a frame that waits on nothing and got no
answer, from the frame's arrival; after its result, at the call's end).
That moment is taken before the write, never after it, because the write wakes the
rank, which may run (and start a sleep) before the broker's thread gets a CPU again.

The lock's condition is the pool's one event path: a frame that changed what the pool waits
for (a rank's outcome, its stack: every frame but a call's own operations, and those that
end the rank's call, :data:`grader.protocol.OPERATIONS`), a rank's connection
ended, a relay's word of how its rank ended, and, from outside, the job's end
(:meth:`Connections.end_job`: its torchrun exited, a node went) each notify it, and
whoever waits on the job waits there, with no poll.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from grader import protocol, segment, wire
from grader.broker import accounting
from grader.broker.accounting import LocalTime, Reading
from grader.broker.ops import RankState
from grader.segment import BrokerSegment, settled, take_payloads
from grader.wire import Frame

#: Frames that carry at most this many payload bytes in themselves (not in the segment)
#: are written at once, under the lock, if nothing is queued before them, the socket takes
#: them whole and is the rank's own.
DIRECT = 64 << 10
#: The writer thread writes at most this much in one system call: a blocking ``send`` on a
#: Unix socket returns only once all it was given is written, and a rank is free from the
#: beginning of the last call (:class:`Outbox`).
_CALL_BYTES = 256 << 10


@dataclass
class Outbox:
    """The frames queued for one rank, and what runs once they are written."""

    ready: threading.Condition  # on the broker's lock: a frame was queued, or the rank ended
    frames: deque[Frame | bytes] = field(default_factory=deque)  # bytes: a frame's rest
    writing: bool = False  # the writer has taken a frame and not finished writing it
    # When the latest system call writing to the rank began: from then on it could have all
    # that was taken from ``frames`` (None: a frame is taken and its writing not yet begun).
    # Taken before the call, never after it: the write wakes the rank, which may run (and
    # start a sleep) long before the writing thread gets a CPU again.
    reached_at: float | None = None
    # The rank's release once they are written: its call's local time, the figures it is
    # free with, and the earliest it is free from (:meth:`Connections.release`).
    then: tuple[LocalTime, Reading | None, float] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)  # held while one is written

    @property
    def busy(self) -> bool:
        """Something waits to be written, or is being written."""
        return bool(self.frames) or self.writing


class Reader(Protocol):
    """Who reads the ranks' frames (the broker), each call under the connections' lock."""

    def handle(self, rank: int, frame: Frame, unreadable: wire.WireError | None) -> None:
        """A frame from ``rank``'s own code; ``unreadable``: why its payloads were not taken."""

    def holds(self, frame: Frame) -> bool:
        """Whether ``frame``'s payloads stay in its rank's ring (asked without the lock)."""

    def records(self, rank: int) -> tuple[int, int]: ...  # events, waits of its call on record

    def relay_said(self, rank: int, frame: Frame) -> None:
        """A frame only ``rank``'s trusted relay may send (:data:`protocol.RELAY_ONLY`)."""

    def broke(self, rank: int, error: str) -> None:
        """``rank``'s bytes broke the frame format: its connection is read no further."""


class Connections:
    """Every rank's connection, its state (:class:`RankState`) and what is queued for it;
    ``cv`` is the one lock of the broker's parts. Each frame read goes to ``reader``."""

    def __init__(self, world_size: int, frame_bytes: int, reader: Reader) -> None:
        self.world_size = world_size
        self.reader = reader
        self._frame_bytes = frame_bytes  # the most one frame of a rank may hold
        lock = threading.RLock()
        self.cv = threading.Condition(lock)
        self.ranks = [RankState(r) for r in range(world_size)]
        self.outboxes = [Outbox(threading.Condition(lock)) for _ in range(world_size)]
        self._listeners: list[socket.socket] = []
        self.ended: str | None = None  # why the job as a whole ended, once it did
        self._closed = False  # the pool closed: every writer thread ends

    def end_job(self, why: str) -> None:
        """The job cannot go on (its torchrun exited, a node went): wake whoever waits."""
        with self.cv:
            if self.ended is None:
                self.ended = why
            self.cv.notify_all()

    def accept_on(self, listeners: list[socket.socket]) -> None:
        """Take over every rank's listening Unix socket (rank r's at ``listeners[r]``): the
        ranks of this machine. A rank that connected before waits in its socket's backlog."""
        for rank, listener in enumerate(listeners):
            self._listeners.append(listener)
            threading.Thread(target=self._accept, args=(rank, listener), daemon=True).start()

    def dead(self) -> list[int]:
        with self.cv:
            return [r.rank for r in self.ranks if not r.alive]

    def close(self) -> None:
        with self.cv:
            self._closed = True
            for state, outbox in zip(self.ranks, self.outboxes, strict=True):
                outbox.ready.notify()
                if state.sock is not None:
                    with contextlib.suppress(OSError):  # ends a write in progress, if any
                        state.sock.shutdown(socket.SHUT_RDWR)
                    with outbox.lock:  # never closed under a write
                        state.sock.close()
                if state.segment is not None:
                    state.segment.close()
                    state.segment = None
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
        with self.cv:
            state = self.ranks[rank]
            if state.sock is not None:  # one connection per rank
                sock.close()
                return
            state.sock = sock
            state.segment = None if relayed else _offer_segment(sock)
            self.cv.notify_all()
        threading.Thread(target=self._write, args=(rank, sock), daemon=True).start()
        # The process to meter is the one that speaks: its wrapper made the connection.
        pid = None if relayed else accounting.sender_pid(sock)
        meter = accounting.Meter(pid) if pid is not None else None
        with self.cv:
            state.meter = meter
        outbox = self.outboxes[rank]
        began: list[float] = [0.0]

        def beginning() -> None:  # a frame's first bytes: the rank ran at least until then
            began[0] = time.monotonic()

        try:
            while (frame := wire.recv_frame(sock, self._frame_bytes, beginning)) is not None:
                # Whole: from now on the rank may wait on the broker. A reading costs some
                # 10 µs: only where the call is timed.
                arrived = meter.read() if meter is not None and state.local.measured else None
                hold = state.running and self.reader.holds(frame)
                unreadable = _take_payloads(state.segment, frame, hold)
                with self.cv:
                    outcome = state.outcome
                    if relayed and frame.header["type"] in protocol.RELAY_ONLY:
                        self.reader.relay_said(rank, frame)
                    else:
                        self._arrived(
                            rank, frame, unreadable, _late(state, meter, arrived), began[0]
                        )
                    if (
                        frame.header["type"] not in protocol.OPERATIONS
                        or state.outcome is not outcome
                    ):
                        self.cv.notify_all()
        except (OSError, wire.WireError) as err:
            if not isinstance(err, OSError):
                with self.cv:
                    self.reader.broke(rank, str(err))
        with self.cv:
            state.alive = False
            outbox.ready.notify()  # its writer ends
            if state.segment is not None:
                state.segment.close()
                state.segment = None
            if meter is not None:
                meter.close()
            self.cv.notify_all()

    def _arrived(
        self, rank: int, frame: Frame, unreadable: wire.WireError | None,
        arrived: Reading | None, began: float,
    ) -> None:  # fmt: skip
        """Handle a frame of ``rank``'s that ``arrived`` whole, its first bytes at ``began``
        (under the lock), and account for the rank's time around it."""
        state, outbox = self.ranks[rank], self.outboxes[rank]
        if state.running and outbox.then is not None:
            # This frame began before the writer, late to the lock, freed the rank: it was
            # free from when the latest write to it began, or at the latest from this frame's
            # beginning (it ran).
            _run_release(outbox, _freed(outbox, began))
        if state.running:
            state.local.arrived(arrived, self.reader.records(rank))
        written = outbox.reached_at
        self.reader.handle(rank, frame, unreadable)
        if state.running and state.blocked_on is None:
            # Free from the answer written to it meanwhile, if any (the write woke it, and it
            # may have run before this thread), else from the frame's arrival: it waits for
            # nothing. With the arrival's figures: the broker's work since ran on none of
            # the rank's threads.
            answered = outbox.reached_at
            at = answered if answered != written else arrived.at if arrived else None
            self.release(rank, arrived, at)

    # -- what the broker sends ----------------------------------------------------------------

    def send(self, rank: int, frame: Frame) -> float | None:
        """Send ``frame`` to ``rank`` (under the lock). If nothing is queued before it, its
        payloads go into the rank's segment at once, and the frame goes out at once if the
        rank's own socket takes it whole without waiting: then the moment that write began.
        What is left of it otherwise goes to the rank's writer thread, as does every frame
        to a rank behind a relay (None: queued, or dropped for a rank gone)."""
        state, outbox = self.ranks[rank], self.outboxes[rank]
        if state.sock is None or not state.alive:
            return None
        queued: Frame | bytes = frame
        if not outbox.busy and isinstance(state.sock, socket.socket):  # not a relay's channel
            shared = state.segment
            frame = queued = shared.place(frame) if shared is not None else settled(frame)
            if sum(map(len, frame.buffers)) <= DIRECT:
                data = b"".join([wire.head_of(frame), *frame.buffers])
                at = time.monotonic()  # before the write: the rank may run as soon as it is in
                try:
                    sent = state.sock.send(data, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    state.alive = False
                    outbox.ready.notify()  # its writer ends
                    self.cv.notify_all()
                    return None
                if sent == len(data):
                    outbox.reached_at = at
                    return at
                queued = data[sent:]
        outbox.frames.append(queued)
        outbox.ready.notify()
        return None

    def release(self, rank: int, reading: Reading | None, at: float | None) -> None:
        """``rank`` is free (its call's local time runs), with ``reading``'s figures, from
        ``at`` (None: now), or, if something queued for it waits to be written, from when
        the last system call writing that began, if later: their transfer is never its free
        time. A frame of the rank's that begins before then frees it at once: it ran."""
        outbox = self.outboxes[rank]
        outbox.then = (self.ranks[rank].local, reading, at if at is not None else time.monotonic())
        if not outbox.busy:
            _run_release(outbox)

    def _write(self, rank: int, sock: socket.socket) -> None:
        """Write the frames queued for ``rank``, in order, payloads into its segment where they
        fit, until its connection ends or the pool closes (the thread's body). A rank that does
        not read blocks only this thread."""
        state, outbox = self.ranks[rank], self.outboxes[rank]
        try:
            while True:
                with outbox.ready:
                    if outbox.writing and not outbox.frames:
                        # All written: the rank is free from then, and who waits for that goes on.
                        _run_release(outbox, outbox.reached_at)
                        self.cv.notify_all()
                    outbox.writing = False
                    while not outbox.frames and state.alive and not self._closed:
                        outbox.ready.wait()
                    if not state.alive or self._closed:
                        return
                    item = outbox.frames.popleft()
                    outbox.writing, outbox.reached_at, shared = True, None, state.segment
                with outbox.lock:
                    if isinstance(item, bytes):  # the rest of a frame begun at once
                        _write_all(sock, [item], outbox)
                    else:
                        item = shared.place(item) if shared else settled(item)
                        _write_all(sock, [wire.head_of(item), *item.buffers], outbox)
        except OSError:
            pass
        finally:  # whatever ended it, nothing more is written to this connection
            with self.cv:
                state.alive = False
                outbox.frames.clear()
                outbox.writing = False
                self.cv.notify_all()


def _write_all(sock: socket.socket, parts: list[bytes], outbox: Outbox) -> None:
    """Write ``parts`` in order, waiting as long as it takes, each system call's beginning in
    ``outbox.reached_at`` (a relay's channel, whose rank is not timed: the first one's)."""
    if not isinstance(sock, socket.socket):  # a sealed channel writes whole records
        outbox.reached_at = time.monotonic()
        for part in parts:
            sock.sendall(part)
        return
    for part in parts:
        view = memoryview(part).cast("B")
        while view:  # a call at most a socket buffer long: it begins close to its end
            outbox.reached_at = time.monotonic()
            view = view[sock.send(view[:_CALL_BYTES]) :]


def _run_release(outbox: Outbox, at: float | None = None) -> None:
    """The release waiting for ``outbox`` to be written, if any, from ``at`` but never before
    the moment it asked for (under the lock)."""
    if outbox.then is not None:
        local, reading, earliest = outbox.then
        outbox.then = None
        local.released(reading, max(earliest, at) if at is not None else earliest)


def _freed(outbox: Outbox, began: float) -> float | None:
    """When a rank whose frame ``began`` while its release waited was freed: when the latest
    system call writing to it began, if nothing is left queued (the writer may not yet have
    had a CPU since it ended; a call is at most :data:`_CALL_BYTES`), and no later than the
    frame's beginning."""
    reached = outbox.reached_at if not outbox.frames else None
    return min(reached, began) if reached is not None else began


def _late(
    state: RankState, meter: accounting.Meter | None, arrived: Reading | None
) -> Reading | None:
    """``arrived``, or where it was not read (the frame arrived before a timed call started,
    and is handled in it) or was read before the call started, a reading now: that only counts
    more of the rank's time (unread, the whole call would go unmeasured, as a rank that leaves
    a frame half-sent between calls would like). Under the lock."""
    first = state.local.first
    stale = arrived is None or (first is not None and arrived.at < first.at)
    if stale and state.running and state.local.measured and meter is not None:
        return meter.read()
    return arrived


def _take_payloads(
    segment: BrokerSegment | None, frame: Frame, hold: bool
) -> wire.WireError | None:
    """The broker's own copy of the payloads ``frame`` names in the rank's segment (or with
    ``hold``, what refers to them there), made on the rank's reader thread before the broker's
    lock is taken, so that the copies of several ranks run side by side; the error, if they
    cannot be taken."""
    try:
        take_payloads(segment, frame, hold)
    except wire.WireError as err:
        return err
    return None


def _offer_segment(sock: socket.socket) -> BrokerSegment | None:
    """A new segment for the rank at the other end of ``sock``, its descriptor sent in the
    rank's first frame; None where the system has none to give (payloads go in frames)."""
    if not segment.AVAILABLE:
        return None
    try:
        shared = BrokerSegment()
    except OSError:
        return None
    try:
        wire.send_frame(sock, Frame({"type": protocol.SEGMENT}), [shared.fd])
    except OSError:
        shared.close()
        return None
    shared.handed()
    return shared
