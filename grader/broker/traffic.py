"""What the broker saw of one call: every message and collective, per rank, in program order.

These records are made by the trusted broker alone, from what it carried;
the communication and performance judges read nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from time import monotonic
from typing import Any

from grader.broker.accounting import LocalTime


@dataclass(frozen=True)
class Event:
    """One operation a rank posted: ``op`` is "send", "recv" or a collective's name."""

    op: str
    peer: int  # the other rank of a message; -1 for a collective
    nbytes: int
    tag: int = 0
    at: str = ""  # the student's line that posted it
    dtype: str = ""  # a collective's first input tensor's dtype ("float32"), as the rank sent it
    # The broker's clock when it recorded the event (the rank posted the operation): what the
    # schedule pictures draw, never what a verdict rests on.
    posted: float = field(default_factory=monotonic, compare=False)
    # The bytes a send carried, or a collective's inputs end to end: for tests that check what
    # a message holds, not only its size. Empty for a receive.
    payload: bytes | bytearray | memoryview = field(default=b"", repr=False, compare=False)
    # A collective's inputs one by one: an all-to-all's bytes for each destination, in order.
    pieces: tuple[int, ...] = field(default=(), compare=False)
    # A broadcast's source, a global rank, as the broker computed it; -1 for any other op.
    root: int = field(default=-1, compare=False)

    def as_dict(self) -> dict[str, Any]:
        return {"op": self.op, "peer": self.peer, "nbytes": self.nbytes, "tag": self.tag}


@dataclass(frozen=True)
class Wait:
    """A rank asked for an operation's outcome: it could not use a received message before."""

    after: int  # how many of the rank's events were posted before it
    of: int  # the position of the awaited event among the rank's events


@dataclass(frozen=True)
class GatePass:
    """A rank's scenario passed a gate (:class:`grader.broker.ops.Gate`)."""

    label: str
    opened: bool  # what the gate needs had been sent before it
    after: int  # how many of the rank's events were posted before it


@dataclass
class Traffic:
    """Every rank's events during one call, and when it waited for which of them."""

    per_rank: list[list[Event]] = field(default_factory=list)
    waits: list[list[Wait]] = field(default_factory=list)
    delivered: list[int] = field(default_factory=list)  # bytes handed to each rank
    gates: list[list[GatePass]] = field(default_factory=list)
    # (rank, position of a receive among its events) -> how many of the rank's events the
    # broker had recorded when it handed the message over: what it received can only reach
    # operations from there on (an ``is_completed()`` may ask long before the message comes).
    handed: dict[tuple[int, int], int] = field(default_factory=dict)
    # Each rank's local time in the call, from the kernel's accounting (broker.accounting).
    local: list[LocalTime] = field(default_factory=list)

    @classmethod
    def empty(cls, world_size: int) -> Traffic:
        ranks = range(world_size)
        return cls(
            [[] for _ in ranks], [[] for _ in ranks], [0 for _ in ranks], [[] for _ in ranks]
        )

    def messages(self) -> list[list[dict[str, Any]]]:
        """Every rank's point-to-point events and its waits for them, in program order, as the
        replays want them: ``{"op": "wait", "of": i}`` waits for the rank's i-th message."""
        return [self._messages(rank) for rank in range(len(self.per_rank))]

    def _messages(self, rank: int) -> list[dict[str, Any]]:
        events, waits = self.per_rank[rank], self.waits[rank] if self.waits else []
        index: dict[int, int] = {}  # position among all events -> among the messages
        out: list[dict[str, Any]] = []
        pending = iter(waits)
        wait = next(pending, None)
        for position in range(len(events) + 1):
            while wait is not None and wait.after == position:
                if wait.of in index:
                    out.append({"op": "wait", "of": index[wait.of]})
                wait = next(pending, None)
            if position < len(events) and events[position].peer >= 0:
                index[position] = len(out)
                out.append(events[position].as_dict())
        return out

    def collectives(self, rank: int, *names: str) -> list[Event]:
        return [
            e
            for e in self.per_rank[rank]
            if e.peer < 0 and e.op != "mark" and (not names or e.op in names)
        ]

    def split_at_gate(self, rank: int, label: str) -> tuple[list[Event], list[Event]] | None:
        """The rank's operations before it passed the gate ``label``, and from it on (marks
        left out); None if it never passed it."""
        passed = next((g for g in self.gates[rank] if g.label == label), None)
        if passed is None:
            return None
        events = self.per_rank[rank]
        operations = [e for e in events[: passed.after] if e.op != "mark"]
        return operations, [e for e in events[passed.after :] if e.op != "mark"]

    def marks(self, rank: int) -> list[tuple[int, str]]:
        """(position among the rank's events, label) of every mark the rank's scenario made."""
        return [(i, e.at) for i, e in enumerate(self.per_rank[rank]) if e.op == "mark"]

    def bytes_sent(self, rank: int) -> int:
        return sum(e.nbytes for e in self.per_rank[rank] if e.op == "send")

    def bytes_received(self, rank: int) -> int:
        return sum(e.nbytes for e in self.per_rank[rank] if e.op == "recv")

    def handed_after(self, rank: int, event: int) -> int | None:
        """How many of the rank's events came before the broker handed it what its receive
        ``event`` got; None if it never did."""
        return self.handed.get((rank, event))
