"""What the broker saw of one call: every message and collective, per rank, in program order.

These records are made by the trusted broker alone, from what it carried;
the communication and performance judges read nothing else.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from time import monotonic
from typing import Any

from grader.broker.accounting import Gap, LocalTime
from grader.protocol import OpName


@dataclass(frozen=True)
class Event:
    """One operation a rank posted: ``op`` is "send", "recv" or a collective's name."""

    op: str
    peer: int  # the other rank of a message; -1 for a collective
    nbytes: int
    tag: int = 0
    at: str = ""  # the student's line that posted it
    dtype: str = ""  # its (a collective's first input) tensor's dtype ("float32"), as sent
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
    # A collective's group: the world ranks of its members, in group order, as the broker
    # matched it; empty for any other op. What a collective carried reached only these ranks.
    group: tuple[int, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class Message:
    """One entry of a rank's message log, as the replays read it (:meth:`Traffic.messages`):
    a send or a receive (its peer, bytes and tag), or a wait for the rank's ``of``-th entry."""

    op: OpName  # SEND, RECV or WAIT
    peer: int = -1
    nbytes: int = 0
    tag: int = 0
    of: int = -1  # a wait's: the position of the entry it waits for

    @classmethod
    def of_event(cls, event: Event) -> Message:
        return cls(OpName(event.op), event.peer, event.nbytes, event.tag)

    @classmethod
    def wait(cls, of: int) -> Message:
        return cls(OpName.WAIT, of=of)

    @classmethod
    def from_json(cls, raw: object) -> Message:
        """An entry of ``reference_traces.json``; ValueError if it is not one."""
        if not isinstance(raw, dict) or raw.get("op") not in _LOGGED:
            raise ValueError(f"not a logged message: {raw!r}")
        fields = ("of",) if raw["op"] == OpName.WAIT else ("peer", "nbytes", "tag")
        if set(raw) != {"op", *fields} or not all(type(raw[f]) is int for f in fields):
            raise ValueError(f"not a logged message: {raw!r}")
        return cls(OpName(raw["op"]), **{f: raw[f] for f in fields})

    def to_json(self) -> dict[str, Any]:
        if self.op is OpName.WAIT:
            return {"op": self.op.value, "of": self.of}
        return {"op": self.op.value, "peer": self.peer, "nbytes": self.nbytes, "tag": self.tag}


_LOGGED = (OpName.SEND, OpName.RECV, OpName.WAIT)


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


@dataclass(frozen=True)
class RankWork:
    """One rank's local time in a call, laid on its message log (:meth:`Traffic.messages`):
    ``before[i]`` seconds (on a CPU, or outside: :mod:`grader.broker.accounting`) before its
    i-th entry, ``tail`` after its last; ``longest_cpu`` and ``longest_outside``: its longest
    stretch of each, and before which operation it came."""

    before: tuple[float, ...]
    tail: float
    cpu: float
    outside: float
    waiting: float  # runnable but not running: the machine's load, never the rank's work
    longest_cpu: tuple[float, str]
    longest_outside: tuple[float, str]


def _where(event: Event, wait: Wait | None) -> str:
    """The operation a stretch of local time came before, in the student's words."""
    line = f" at {event.at}" if event.at else ""
    if wait is not None:
        return f"before waiting for the {event.op}{line}"
    return f"before the {event.op}{line}"


@dataclass
class Traffic:
    """Every rank's events during one call, and when it waited for which of them."""

    per_rank: list[list[Event]] = field(default_factory=list)
    waits: list[list[Wait]] = field(default_factory=list)
    # Bytes handed to each rank that it did not send itself: a collective's result less its
    # own input handed back (a group of one's whole result, a broadcast root's tensor, its
    # own piece of an all-gather or an all-to-all: :func:`grader.broker.matching.echoed`).
    delivered: list[int] = field(default_factory=list)
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

    def messages(self) -> list[list[Message]]:
        """Every rank's point-to-point events and its waits for them, in program order, as the
        replays want them: ``Message.wait(i)`` waits for the rank's i-th message."""
        return [[entry for _, entry in self._messages(rank)] for rank in range(len(self.per_rank))]

    def local_work(self) -> list[RankWork] | None:
        """Every rank's local time in the call, put before the entries of :meth:`messages` it
        delayed; None where a rank's was not measured (:mod:`grader.broker.accounting`)."""
        if len(self.local) != len(self.per_rank) or not all(t.measured for t in self.local):
            return None
        return [self._local_work(rank) for rank in range(len(self.per_rank))]

    def _records(self, rank: int) -> Iterator[tuple[tuple[int, int], Event, Wait | None]]:
        """The rank's events and waits in program order, each with the (events, waits) the
        broker held of the rank when it was recorded, and the event (awaited, for a wait)."""
        events, waits = self.per_rank[rank], self.waits[rank] if self.waits else []
        pending = iter(enumerate(waits))
        wait = next(pending, None)
        for position, event in enumerate(events):
            while wait is not None and wait[1].after == position:
                yield (position, wait[0]), events[wait[1].of], wait[1]
                wait = next(pending, None)
            yield (position, wait[0] if wait else len(waits)), event, None
        while wait is not None:  # waits after its last event
            yield (len(events), wait[0]), events[wait[1].of], wait[1]
            wait = next(pending, None)

    def _messages(self, rank: int) -> Iterator[tuple[tuple[int, int], Message]]:
        """:meth:`messages` of one rank, each entry with when it was recorded."""
        index: dict[int, int] = {}  # position among all events -> among the messages
        count = 0
        for recorded, event, wait in self._records(rank):
            if wait is not None and wait.of in index:
                entry = Message.wait(index[wait.of])
            elif wait is None and event.peer >= 0:
                index[recorded[0]], entry = count, Message.of_event(event)
            else:
                continue
            count += 1
            yield recorded, entry

    def _local_work(self, rank: int) -> RankWork:
        """The rank's gaps (:class:`~grader.broker.accounting.Gap`), each put before the first
        entry of :meth:`messages` recorded after it; what follows the last one is the tail."""
        local = self.local[rank]
        ended_at: dict[tuple[int, int], list[Gap]] = defaultdict(list)
        for gap in local.gaps:
            ended_at[gap.records].append(gap)
        entries = {recorded for recorded, _ in self._messages(rank)}
        records = [(recorded, _where(event, wait)) for recorded, event, wait in self._records(rank)]
        final = (len(self.per_rank[rank]), len(self.waits[rank]))
        before: list[float] = []
        pending, cpu, outside = 0.0, (0.0, ""), (0.0, "")
        for recorded, where in [*records, (final, "before it returned")]:
            for gap in ended_at.pop(recorded, ()):
                pending += gap.cpu + gap.outside
                cpu = max(cpu, (gap.cpu, where))
                outside = max(outside, (gap.outside, where))
            if recorded in entries:
                before.append(pending)
                pending = 0.0
        pending += sum(g.cpu + g.outside for gaps in ended_at.values() for g in gaps)
        return RankWork(
            tuple(before), pending, local.cpu, local.outside, local.waiting, cpu, outside
        )

    def collectives(self, rank: int, *names: str) -> list[Event]:
        """The rank's collectives (``names`` only, if given), in whatever group."""
        return [
            e
            for e in self.per_rank[rank]
            if e.peer < 0 and e.op != OpName.MARK and (not names or e.op in names)
        ]

    @property
    def world(self) -> tuple[int, ...]:
        """The ranks of the call: the group of ``torch.distributed``'s default group."""
        return tuple(range(len(self.per_rank)))

    def among_all(self, event: Event) -> bool:
        """Whether the event is a message, a mark, or a collective of every rank of the call;
        not a collective of a smaller group (of one: what it carried never left its rank)."""
        return event.peer >= 0 or event.op == OpName.MARK or event.group == self.world

    def exchanged(self, rank: int) -> list[Event]:
        """The rank's events, its collectives of any group but the whole call's left out: what
        a test of a strategy on the default group judges (:meth:`among_all`)."""
        return [e for e in self.per_rank[rank] if self.among_all(e)]

    def world_collectives(self, rank: int, *names: str) -> list[Event]:
        """The rank's collectives (``names`` only, if given) of every rank of the call."""
        return [e for e in self.collectives(rank, *names) if e.group == self.world]

    def split_at_gate(self, rank: int, label: str) -> tuple[list[Event], list[Event]] | None:
        """The rank's operations before it passed the gate ``label``, and from it on (marks
        left out); None if it never passed it."""
        passed = next((g for g in self.gates[rank] if g.label == label), None)
        if passed is None:
            return None
        events = self.per_rank[rank]
        operations = [e for e in events[: passed.after] if e.op != OpName.MARK]
        return operations, [e for e in events[passed.after :] if e.op != OpName.MARK]

    def handed_after(self, rank: int, event: int) -> int | None:
        """How many of the rank's events came before the broker handed it what its receive
        ``event`` got; None if it never did."""
        return self.handed.get((rank, event))
