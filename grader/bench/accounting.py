"""Records the messages of one call during ``grader bench``, for the projections it shows.

    with recording() as log:
        student.all_reduce(tensor)
    messages = log.messages()

Sends are logged when posted, receives when they complete, in the rank's
program order: that is what the projection needs to rebuild the chain of
messages across ranks.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from grader.bench import p2p
from grader.protocol import OpName


@dataclass(frozen=True)
class LoggedMessage:
    """A message the bench's rank logged: which way, with whom, how big, and when."""

    op: str  # "send" or "recv"
    peer: int
    nbytes: int
    tag: int
    time: float  # time.perf_counter() when logged


class CommLog(p2p.MessageLog):
    def __init__(self) -> None:
        self.events: list[LoggedMessage] = []

    def on_send(self, peer: int, nbytes: int, tag: int) -> None:
        self.events.append(LoggedMessage(OpName.SEND, peer, nbytes, tag, time.perf_counter()))

    def on_recv(self, peer: int, nbytes: int, tag: int) -> None:
        self.events.append(LoggedMessage(OpName.RECV, peer, nbytes, tag, time.perf_counter()))

    def messages(self) -> list[dict]:
        """The messages, in program order, as JSON-ready records."""
        return [asdict(e) for e in self.events]


@contextlib.contextmanager
def recording() -> Iterator[CommLog]:
    log = CommLog()
    previous, p2p.active_log = p2p.active_log, log
    try:
        yield log
    finally:
        p2p.active_log = previous
