"""What the broker saw of one call: every message and collective, per rank, in program order.

These records are made by the trusted broker alone, from what it carried;
the communication and performance judges read nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Event:
    """One operation a rank posted: ``op`` is "send", "recv" or a collective's name."""

    op: str
    peer: int  # the other rank of a message; -1 for a collective
    nbytes: int
    tag: int = 0
    at: str = ""  # the student's line that posted it
    dtype: str = ""  # a collective's first input tensor's dtype ("float32"), as the rank sent it
    # The bytes a send carried, or a collective's inputs end to end: for tests that check what
    # a message holds, not only its size. Empty for a receive.
    payload: bytes | bytearray = field(default=b"", repr=False, compare=False)

    def as_dict(self) -> dict[str, Any]:
        return {"op": self.op, "peer": self.peer, "nbytes": self.nbytes, "tag": self.tag}


@dataclass
class Traffic:
    """Every rank's events during one call."""

    per_rank: list[list[Event]] = field(default_factory=list)

    @classmethod
    def empty(cls, world_size: int) -> Traffic:
        return cls([[] for _ in range(world_size)])

    def messages(self) -> list[list[dict[str, Any]]]:
        """The point-to-point events of every rank, as the replays want them."""
        return [[e.as_dict() for e in events if e.peer >= 0] for events in self.per_rank]

    def collectives(self, rank: int, *names: str) -> list[Event]:
        return [
            e
            for e in self.per_rank[rank]
            if e.peer < 0 and e.op != "mark" and (not names or e.op in names)
        ]

    def marks(self, rank: int) -> list[tuple[int, str]]:
        """(position among the rank's events, label) of every mark the rank's scenario made."""
        return [(i, e.at) for i, e in enumerate(self.per_rank[rank]) if e.op == "mark"]

    def bytes_sent(self, rank: int) -> int:
        return sum(e.nbytes for e in self.per_rank[rank] if e.op == "send")

    def bytes_received(self, rank: int) -> int:
        return sum(e.nbytes for e in self.per_rank[rank] if e.op == "recv")
