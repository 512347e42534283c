"""Records the communication of a piece of student code, for tests to count and judge.

    with ctx.recording() as log:
        student.all_reduce(tensor)
    ctx.extra["per_rank"] = {"messages": log.messages()}

Sends are logged when posted, receives when they complete, each with a
sequence number in the rank's program order: that is what the judge needs to
rebuild the chain of messages across ranks and count the rounds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from grader.bench import p2p


@dataclass(frozen=True)
class Event:
    op: str  # "send", "recv", or a collective's name ("all_reduce", "allreduce", ...)
    peer: int  # -1 for a collective
    nbytes: int
    tag: int
    time: float  # time.perf_counter() when logged


class CommLog(p2p.MessageLog):
    def __init__(self) -> None:
        self.events: list[Event] = []

    def on_send(self, peer: int, nbytes: int, tag: int) -> None:
        self.events.append(Event("send", peer, nbytes, tag, time.perf_counter()))

    def on_recv(self, peer: int, nbytes: int, tag: int) -> None:
        self.events.append(Event("recv", peer, nbytes, tag, time.perf_counter()))

    def on_collective(self, name: str, nbytes: int) -> None:
        self.events.append(Event(name, -1, nbytes, 0, time.perf_counter()))

    def messages(self) -> list[dict]:
        """The point-to-point events, in program order, as JSON-ready records."""
        return [asdict(e) for e in self.events if e.op in ("send", "recv")]

    def collectives(self, *names: str) -> list[Event]:
        return [e for e in self.events if e.peer == -1 and (not names or e.op in names)]

    @property
    def bytes_sent(self) -> int:
        return sum(e.nbytes for e in self.events if e.op == "send")

    @property
    def bytes_received(self) -> int:
        return sum(e.nbytes for e in self.events if e.op == "recv")


@contextlib.contextmanager
def recording() -> Iterator[CommLog]:
    log = CommLog()
    previous, p2p.active_log = p2p.active_log, log
    try:
        yield log
    finally:
        p2p.active_log = previous
