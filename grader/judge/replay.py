"""Replaying the message logs of all ranks together, matching each receive with its send.

The k-th send from rank r to rank s with a tag is the message the k-th
receive at s from r with that tag gets (the order point-to-point messages
keep). Each rank's log is its program order: sends, receives and waits, as
the broker recorded them. Posting a send or a receive never blocks; a rank
waits at a ``wait`` for a receive until that receive's message has arrived.
The broker hands a message to its rank only when the rank waits for it, so a
wait is where the rank could first use what it received: what happens after
it may depend on that message, nothing before it can.

A log that the broker recorded from a call that ended well always replays to
its end (every wait's message was sent before the wait was answered). One
that does not is refused: :class:`ReplayError` says which rank waits for
what, and no figure is made from half a replay. Counting rounds and
projecting times are both such replays, with different clocks.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable

from grader.broker.traffic import Message
from grader.protocol import OpName


class ReplayError(ValueError):
    """A message log that cannot be replayed to its end; the message says where it stops."""


def replay(
    per_rank: list[list[Message]],
    on_send: Callable[[int, Message], float],
    on_arrival: Callable[[int, Message, float], None],
    before: Callable[[int, int], None] | None = None,
) -> None:
    """Call ``on_send`` for every send (it returns when the message is there) and
    ``on_arrival`` for every awaited receive, with that value, in an order that respects both;
    ``before(rank, i)`` once as the rank reaches its i-th entry, before anything of it.

    A receive its rank never waited for counts as waited at the rank's end.
    """
    sent: dict[tuple[int, int, int], deque[float]] = defaultdict(deque)  # arrival times
    matched: list[dict[int, float]] = [{} for _ in per_rank]  # receive position -> arrival
    posted: dict[tuple[int, int, int], deque[tuple[int, int]]] = defaultdict(deque)
    waited: list[set[int]] = [set() for _ in per_rank]
    position = [0] * len(per_rank)
    reached = [-1] * len(per_rank)  # the last entry ``before`` was called for

    def match(key: tuple[int, int, int]) -> None:
        while sent[key] and posted[key]:
            rank, index = posted[key].popleft()
            matched[rank][index] = sent[key].popleft()

    progress = True
    while progress:
        progress = False
        for rank, events in enumerate(per_rank):
            while position[rank] < len(events):
                index, event = position[rank], events[position[rank]]
                if before is not None and reached[rank] < index:
                    reached[rank] = index
                    before(rank, index)
                if event.op is OpName.SEND:
                    key = (rank, event.peer, event.tag)
                    sent[key].append(on_send(rank, event))
                    match(key)
                elif event.op is OpName.RECV:
                    key = (event.peer, rank, event.tag)
                    posted[key].append((rank, index))
                    match(key)
                elif event.op is OpName.WAIT and _is_recv(events, event.of):
                    of = event.of
                    if of not in matched[rank]:
                        break  # its message is not replayed yet: come back to this rank later
                    if of not in waited[rank]:
                        waited[rank].add(of)
                        on_arrival(rank, events[of], matched[rank][of])
                position[rank] += 1
                progress = True
    for rank, events in enumerate(per_rank):
        if position[rank] < len(events):
            raise ReplayError(_stuck(rank, events, events[position[rank]].of))
        for of in sorted(set(matched[rank]) - waited[rank]):
            on_arrival(rank, events[of], matched[rank][of])
        receives = [i for i, e in enumerate(events) if e.op is OpName.RECV]
        unmatched = [i for i in receives if i not in matched[rank]]
        if unmatched:
            raise ReplayError(_stuck(rank, events, unmatched[0]))


def _is_recv(events: list[Message], of: int) -> bool:
    if not 0 <= of < len(events):
        raise ReplayError(f"a wait for message {of!r}, which the log does not hold")
    return events[of].op is OpName.RECV


def _stuck(rank: int, events: list[Message], of: int) -> str:
    peer = events[of].peer
    return (
        f"the message pattern could not be replayed: rank {rank} waits for a message from "
        f"rank {peer} that rank {peer} never sends (or sends only after a wait of its own)"
    )
