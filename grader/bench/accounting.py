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
from collections.abc import Iterator

from grader.bench import p2p
from grader.broker.traffic import Message
from grader.protocol import OpName


class CommLog(p2p.MessageLog):
    def __init__(self) -> None:
        self.events: list[Message] = []

    def on_send(self, peer: int, nbytes: int, tag: int) -> None:
        self.events.append(Message(OpName.SEND, peer, nbytes, tag))

    def on_recv(self, peer: int, nbytes: int, tag: int) -> None:
        self.events.append(Message(OpName.RECV, peer, nbytes, tag))

    def messages(self) -> list[Message]:
        """The messages, in program order, as the replays read them."""
        return list(self.events)


@contextlib.contextmanager
def recording() -> Iterator[CommLog]:
    log = CommLog()
    previous, p2p.active_log = p2p.active_log, log
    try:
        yield log
    finally:
        p2p.active_log = previous
