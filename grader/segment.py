"""A rank's shared-memory segment: how payloads move between the broker and a rank of its machine.

The broker makes one segment per rank it reaches by its own Unix socket (never for a
rank on another node, whose relay has no shared memory): a memfd, sealed so that its
size can never change (a rank cannot shrink it under the broker's reads), mapped by the
broker and passed to the rank with ``SCM_RIGHTS`` in the first frame the rank gets
(:data:`grader.protocol.SEGMENT`). It holds two rings::

    control (64 bytes) | out ring (the rank writes, the broker reads) | in ring (the reverse)

A frame whose payloads lie in a ring carries, instead of buffers, ``"shm": [[pos, len], ...]``
in its header: ``pos`` counts bytes from the ring's start forever, so its place in the ring
is ``pos % size``. Each side writes into its ring only what the other has consumed, as the
other says in the control block (the broker writes how far it read the out ring, the rank
how far it read the in ring); a payload that does not fit goes in the frame as before.

Nothing the rank writes is trusted. The broker copies a frame's payloads out of the out
ring into its own memory as it reads the frame, before anything looks at them, and uses
only its copy: what the rank writes there afterwards changes nothing the broker recorded,
checked or hands on. Positions out of the ring are a broken protocol. The broker never reads
the in ring; the rank's count of what it consumed only decides whether the broker's next
payload goes in the ring or in the frame, and a rank that lies about it garbles only what
it receives itself.

One payload is the exception: a message sent in a call whose record keeps no payloads (the
performance tests'). Its bytes matter to its receiver alone, so the broker leaves it in the
sender's out ring (:class:`Held`) and copies it straight into the receiver's in ring when
it hands it over: one copy of four fewer. The out ring is then consumed only up to the
first payload held, so the rank's next payloads never overwrite it. A sender that writes
over its own held payload anyway (it maps the ring) changes only what its receiver gets,
as writing to a tensor during an ``isend`` does in gloo; its size, which is all the broker
checks and counts, is the header's and was checked as the frame was read.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy
import torch

from grader import wire

RING_BYTES = 16 << 20  # each direction; bigger payloads travel in the frame
CONTROL_BYTES = 64
SEGMENT_BYTES = CONTROL_BYTES + 2 * RING_BYTES
_OUT_READ, _IN_READ = 0, 8  # the control block: how far each ring has been consumed
_COUNTER = struct.Struct("=Q")
_MAX_POSITION = 1 << 62
#: Payloads held at once in one rank's out ring, at most; past it they are copied out as read.
HELD_MAX = 256
#: Linux has sealed memfds; elsewhere (a student's Mac) every payload travels in its frame.
AVAILABLE = hasattr(os, "memfd_create") and hasattr(fcntl, "F_SEAL_SHRINK")
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL if AVAILABLE else 0


class Ring:
    """Where the writer of one ring puts its next payloads: positions count bytes forever."""

    def __init__(self, start: int, size: int) -> None:
        self.start, self.size = start, size
        self.head = 0  # the position after the last payload written

    def reserve(self, lengths: Sequence[int], consumed: int) -> list[list[int]] | None:
        """A position for each payload, all of them fitting beside what the reader has not
        yet consumed; None (and nothing reserved) if they do not."""
        head, places = self.head, []
        for length in lengths:
            offset = head % self.size
            if offset + length > self.size:  # never split a payload: start again at 0
                head += self.size - offset
            if head + length - consumed > self.size:
                return None
            places.append([head, length])
            head += length
        self.head = head
        return places

    def span(self, place: list[int]) -> slice:
        """The bytes of the segment that ``place`` names (checked)."""
        offset = place[0] % self.size
        return slice(self.start + offset, self.start + offset + place[1])


def _places(raw: Any, ring: Ring) -> list[list[int]]:
    """The header's ``shm`` field as checked (position, length) pairs: a WireError unless
    every one lies inside the ring, and all of them fit in it at once (as a frame's payloads
    do, reserved together: a frame of a few bytes never makes the reader copy gigabytes)."""
    if not isinstance(raw, list) or len(raw) > wire.MAX_BUFFERS:
        raise wire.WireError("shared-memory payloads are not a list")
    total = 0
    for place in raw:
        if not (
            isinstance(place, list)
            and len(place) == 2
            and all(type(v) is int for v in place)
            and 0 <= place[0] < _MAX_POSITION
            and 0 <= place[1] <= ring.size - place[0] % ring.size
        ):
            raise wire.WireError("a shared-memory payload outside the segment")
        total += place[1]
    if total > ring.size:
        raise wire.WireError("shared-memory payloads larger than the ring")
    return raw


class BrokerSegment:
    """The broker's side of one rank's segment."""

    def __init__(self) -> None:
        fd = os.memfd_create("grader-segment", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, SEGMENT_BYTES)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            self.map = mmap.mmap(fd, SEGMENT_BYTES)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd  # passed to the rank once, then closed here (-1)
        # The broker copies out of the map and into it without its own lock (``take`` on the
        # rank's reader thread, ``place`` on whichever writes to the rank): these locks keep
        # the map open meanwhile, one a ring, so that the two copies never wait on each other.
        self._taking = threading.Lock()
        self._placing = threading.Lock()
        self._closed = False
        self.out = Ring(CONTROL_BYTES, RING_BYTES)
        self.into = Ring(CONTROL_BYTES + RING_BYTES, RING_BYTES)
        self._seen = 0  # the most of the in ring the rank has said it consumed
        self._taken = 0  # the end of the out ring's last payload taken
        self._held: dict[int, int] = {}  # out-ring payloads left where they lie: position: length
        # The rank said it mapped the segment (a ``segment`` frame back): until then, and for
        # a rank that never does, whatever the broker sends it travels in the frames.
        self.mapped = False

    def handed(self) -> None:
        """The rank has its descriptor (or never will): the broker keeps only its mapping."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def take(self, frame: wire.Frame, hold: bool = False) -> None:
        """Replace a frame's ring payloads by the broker's own copy of them, at once; or with
        ``hold``, by :class:`Held` references to them, left in the ring until handed over."""
        raw = frame.header.pop("shm")
        if frame.buffers:
            raise wire.WireError("a frame with payloads both in the segment and in the frame")
        places = _places(raw, self.out)
        with self._taking:
            if self._closed:
                raise wire.WireError("the connection is closing")
            if hold and len(places) == 1 and places[0][1] and len(self._held) < HELD_MAX:
                (place,) = places  # a send's one payload, not empty (an empty one is no place)
                frame.buffers = [Held(self, place[0], place[1])]
                self._held[place[0]] = place[1]
            else:
                frame.buffers = [self._copy(self.out.span(place)) for place in places]
            if places:
                self._taken = places[-1][0] + places[-1][1]
                self._consumed()

    def _consumed(self) -> None:
        """Tell the rank how much of its out ring it may write over: all that was taken, up
        to the first payload still held (under ``_taking``)."""
        _COUNTER.pack_into(self.map, _OUT_READ, min(self._held, default=self._taken))

    def copy_held(self, held: Held, into: memoryview) -> None:
        """Copy a payload held in the out ring into ``into``, and let the rank write over it.
        A payload no longer held (its sender's connection closed, or its call ended) comes as
        zeros: its call has failed already."""
        with self._taking:
            if self._closed or self._held.pop(held.position, None) is None:
                into[:] = bytes(held.length)
                return
            span = self.out.span([held.position, held.length])
            numpy.frombuffer(into, dtype=numpy.uint8)[:] = numpy.frombuffer(
                self.map, dtype=numpy.uint8, count=held.length, offset=span.start
            )
            self._consumed()

    def unhold(self) -> None:
        """A call ended: what it left held will never be handed over."""
        with self._taking:
            if self._held and not self._closed:
                self._held.clear()
                self._consumed()

    def _copy(self, span: slice) -> memoryview:
        """The bytes of ``span``, copied into the broker's memory, read-only.

        The memory comes from numpy (the C library's heap, whose freed blocks are reused
        warm), not torch's allocator, which on this path costs a page fault per 128 KB of
        every fresh copy. So does the copy: it lets the other ranks' threads run meanwhile
        and, unlike torch's, gets the interpreter back at once when it is done, where torch's
        queues behind the threads that ran meanwhile."""
        length = span.stop - span.start
        if not length:
            return memoryview(b"")
        copy = numpy.empty(length, dtype=numpy.uint8)
        copy[:] = numpy.frombuffer(self.map, dtype=numpy.uint8, count=length, offset=span.start)
        return memoryview(copy).toreadonly()

    def place(self, frame: wire.Frame) -> wire.Frame:
        """``frame`` with its payloads copied into the in ring, if the rank mapped it and they
        fit there; else with every :class:`Held` payload of it copied out (:func:`settled`)."""
        if not frame.buffers or not self.mapped:
            return settled(frame)
        with self._placing:
            if self._closed:  # its connection is closing: the frame goes nowhere anyway
                return settled(frame)
            claimed = _COUNTER.unpack_from(self.map, _IN_READ)[0]
            self._seen = min(max(claimed, self._seen), self.into.head)  # a hint, in bounds
            places = self.into.reserve([len(b) for b in frame.buffers], self._seen)
            if places is None:
                return settled(frame)
            for place, buffer in zip(places, frame.buffers, strict=True):
                span = self.into.span(place)
                if isinstance(buffer, Held):  # the one copy from the sender's ring to this one
                    buffer.segment.copy_held(buffer, memoryview(self.map)[span])
                else:
                    _write(self.map, span, buffer)
        return wire.Frame({**frame.header, "shm": places})

    def close(self) -> None:
        # Every placing lock before any taking lock: placing a held payload takes its
        # sender's taking lock under this placing lock.
        with self._placing, self._taking:
            self._closed = True
            self.handed()
            self.map.close()


@dataclass(frozen=True, eq=False)
class Held:
    """A payload left in its sender's out ring, ``length`` bytes at ``position``, until the
    broker hands it over (:meth:`BrokerSegment.copy_held`)."""

    segment: BrokerSegment
    position: int
    length: int

    def __len__(self) -> int:
        return self.length


def settled(frame: wire.Frame) -> wire.Frame:
    """``frame`` with each :class:`Held` payload replaced by the broker's copy of it: for a
    frame that goes out with its payloads, or is kept."""
    if not any(isinstance(b, Held) for b in frame.buffers):
        return frame
    buffers = [_copied(b) if isinstance(b, Held) else b for b in frame.buffers]
    return wire.Frame(frame.header, buffers)


def _copied(held: Held) -> memoryview:
    """A held payload copied into the broker's memory, read-only, as :meth:`BrokerSegment.take`
    copies the others (numpy's heap: see :meth:`BrokerSegment._copy`)."""
    copy = numpy.empty(held.length, dtype=numpy.uint8)
    held.segment.copy_held(held, memoryview(copy))
    return memoryview(copy).toreadonly()


def take_payloads(segment: BrokerSegment | None, frame: wire.Frame, hold: bool = False) -> None:
    """The broker's own copy of the payloads a frame names in its rank's segment, if any (or
    with ``hold``, :class:`Held` references to them); a WireError if they lie outside it, or the
    rank was never given one (a relayed rank)."""
    if "shm" in frame.header:
        if segment is None:
            raise wire.WireError("payloads in a shared segment the rank was never given")
        segment.take(frame, hold)


class RankSegment:
    """The rank's side of its segment, from the descriptor the broker passed."""

    def __init__(self, fd: int) -> None:
        try:
            self.map = mmap.mmap(fd, SEGMENT_BYTES)
        finally:
            os.close(fd)
        self.out = Ring(CONTROL_BYTES, RING_BYTES)
        self.into = Ring(CONTROL_BYTES + RING_BYTES, RING_BYTES)

    def put(self, payloads: Sequence[bytes | torch.Tensor]) -> list[list[int]] | None:
        """Write ``payloads`` into the out ring: their places, or None if they do not fit."""
        flat = [_bytes_of(p) for p in payloads]
        consumed = _COUNTER.unpack_from(self.map, _OUT_READ)[0]
        places = self.out.reserve([_length(p) for p in flat], consumed)
        if places is None:
            return None
        for place, payload in zip(places, flat, strict=True):
            _write(self.map, self.out.span(place), payload)
        return places

    def views(self, raw: Any) -> list[memoryview]:
        """The in ring's payloads that a frame from the broker names, valid until
        :meth:`release`."""
        whole = memoryview(self.map)
        return [whole[self.into.span(place)] for place in _places(raw, self.into)]

    def release(self, raw: list[list[int]]) -> None:
        """The payloads of a frame are consumed: the broker may write over them."""
        if raw:
            _COUNTER.pack_into(self.map, _IN_READ, raw[-1][0] + raw[-1][1])


def _write(map: mmap.mmap, span: slice, payload: bytes | memoryview | torch.Tensor) -> None:
    """Copy ``payload`` (bytes, or a flat uint8 tensor) into ``span`` of ``map``."""
    if not isinstance(payload, torch.Tensor):
        length = span.stop - span.start
        if length:  # by numpy, which lets the process's other threads run meanwhile
            into = numpy.frombuffer(map, dtype=numpy.uint8, count=length, offset=span.start)
            into[:] = numpy.frombuffer(payload, dtype=numpy.uint8)
    elif payload.numel():  # by torch, which lets the process's other threads run meanwhile
        length = payload.numel()
        torch.frombuffer(map, dtype=torch.uint8, count=length, offset=span.start).copy_(payload)


def _bytes_of(payload: bytes | torch.Tensor) -> bytes | torch.Tensor:
    """A tensor as its elements' bytes in row-major order (a flat uint8 tensor)."""
    if isinstance(payload, torch.Tensor):
        return payload.detach().cpu().contiguous().view(-1).view(torch.uint8)
    return payload


def _length(payload: bytes | torch.Tensor) -> int:
    return payload.numel() if isinstance(payload, torch.Tensor) else len(payload)
