"""A rank's one connection to the trusted broker, and the operations waiting on it.

The main thread runs the student's code and posts operations (sends,
receives, collectives); a reader thread takes the broker's answers and
completes them. Calls to run arrive on the same connection and queue up for
the main thread. Nothing here is trusted: the broker decides what happened,
this side only carries it.

A rank that the broker reaches by its own socket gets a shared-memory segment
in the broker's first frame (:mod:`grader.segment`): payloads that fit go
through it, the frames carrying only where they lie; the others, and every
payload of a rank behind a relay, travel in the frames.
"""

from __future__ import annotations

import itertools
import queue
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from grader import protocol, wire
from grader.segment import RankSegment
from grader.wire import Frame

Payload = bytes | torch.Tensor


class BrokerRefused(RuntimeError):
    """The broker refused or aborted an operation (a collective where none is allowed,
    a deadlock, a size mismatch); its message says why."""


@dataclass
class PendingOp:
    """One posted operation; ``on_done`` runs on the reader thread with the broker's answer."""

    id: int
    on_done: Callable[[Frame], None]
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    asked: bool = False

    def wait(self, link: BrokerLink) -> None:
        self.ask(link, block=True)
        self.done.wait()
        if self.error is not None:
            raise BrokerRefused(self.error)

    def ask(self, link: BrokerLink, block: bool = False) -> None:
        """Ask the broker for the outcome (it hands a received message over only then);
        ``block``: this rank now waits for it, which the broker needs to see deadlocks."""
        if not self.asked or (block and not self.done.is_set()):
            self.asked = True
            link.post(protocol.WAIT, op=self.id, block=block)


_current: BrokerLink | None = None


def current() -> BrokerLink | None:
    """This rank's link, once the worker has connected."""
    return _current


class BrokerLink:
    def __init__(self, connection: int, rank: int) -> None:
        """``connection``: the descriptor of a Unix stream socket connected to the broker."""
        global _current
        self.rank = rank
        self.sock = socket.socket(fileno=connection)
        self._write_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, PendingOp] = {}
        self.calls: queue.Queue[Frame | None] = queue.Queue()
        self.stack_reader: Callable[[], list[str]] = lambda: []
        self.segment: RankSegment | None = None
        self._fds: list[int] = []  # descriptors the broker passed, not yet taken
        threading.Thread(target=self._read, name="broker-link", daemon=True).start()
        _current = self

    def post(self, kind: str, payloads: list[Payload] | None = None, **header: Any) -> None:
        """Send a frame with ``payloads`` (a tensor goes as its elements, row-major)."""
        payloads = payloads or []
        with self._write_lock:
            places = self.segment.put(payloads) if self.segment and payloads else None
            if places is not None:
                frame = Frame({"type": kind, **header, "shm": places})
            else:
                buffers = [_bytes(payload) for payload in payloads]
                frame = Frame({"type": kind, **header}, buffers)
            wire.send_frame(self.sock, frame)

    def start_op(
        self, kind: str, on_done: Callable[[Frame], None], buffers: list[Payload], **header: Any
    ) -> PendingOp:
        op = PendingOp(next(self._ids), on_done)
        self._pending[op.id] = op
        self.post(kind, buffers, op=op.id, **header)
        return op

    def _read(self) -> None:
        try:
            while (frame := wire.recv_frame(self.sock, fds=self._fds)) is not None:
                places = frame.header.get("shm")
                if places is not None and self.segment is not None:
                    frame.buffers = self.segment.views(places)
                handler = getattr(self, f"broker_{frame.header['type']}", None)
                if handler is not None:
                    handler(frame)
                if places is not None and self.segment is not None:
                    self.segment.release(places)
        except (OSError, wire.WireError):
            pass
        # The grader is gone: nothing this rank does can count any more.
        self.calls.put(None)
        for op in list(self._pending.values()):
            op.error = "the grader closed the connection"
            op.done.set()

    # -- what the broker sends, one method per message -------------------------------------

    def broker_segment(self, frame: Frame) -> None:
        """Map the segment the broker passed and say so; if it cannot be mapped (no address
        space left), say nothing: every payload then travels in the frames."""
        if not self._fds or self.segment is not None:
            return
        fd = self._fds.pop(0)
        try:
            self.segment = RankSegment(fd)
        except OSError:
            return
        self.post(protocol.SEGMENT)

    def broker_call(self, frame: Frame) -> None:
        frame.buffers = [bytes(buffer) for buffer in frame.buffers]  # the ring is reused
        self.calls.put(frame)

    def broker_done(self, frame: Frame) -> None:
        op = self._pending.pop(frame.header["op"], None)
        if op is None:
            return
        try:
            op.on_done(frame)
        except Exception as err:  # a result that does not fit the student's tensor
            op.error = f"{type(err).__name__}: {err}"
        # Done with: its closure refers to the op's Work, which refers to the op, and such a
        # cycle would keep the op's tensors alive until Python's collector next runs.
        op.on_done = _done_already
        op.done.set()

    def broker_refused(self, frame: Frame) -> None:
        op = self._pending.pop(frame.header["op"], None)
        if op is not None:
            op.error = str(frame.header.get("message", "refused by the grader"))
            op.on_done = _done_already
            op.done.set()

    def broker_dump_stack(self, frame: Frame) -> None:
        self.post(protocol.STACK, frames=self.stack_reader())


def _done_already(frame: Frame) -> None:
    """An operation's handler once it has run."""


def _bytes(payload: Payload) -> bytes:
    return wire.tensor_buffer(payload) if isinstance(payload, torch.Tensor) else payload
