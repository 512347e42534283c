"""Replaying the message logs of all ranks together, matching each receive with its send.

The k-th send from rank r to rank s with a tag is the message the k-th
receive at s from r with that tag gets (the order point-to-point messages
keep). Ranks are walked in their program order; a rank waits at a receive
until its send has been replayed. Receives whose send never appears are
left unmatched. Counting rounds and projecting times are both such replays,
with different clocks.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

Event = dict[str, Any]


def replay(
    per_rank: list[list[Event]],
    on_send: Callable[[int, Event], float],
    on_arrival: Callable[[int, Event, float], None],
) -> None:
    """Call ``on_send`` for every send (it returns when the message is there) and
    ``on_arrival`` for every receive, with that value, in an order that respects both."""
    in_flight: dict[tuple[int, int, int], deque[float]] = defaultdict(deque)
    position = [0] * len(per_rank)
    progress = True
    while progress:
        progress = False
        for rank, events in enumerate(per_rank):
            while position[rank] < len(events):
                event = events[position[rank]]
                if event["op"] == "send":
                    in_flight[(rank, event["peer"], event["tag"])].append(on_send(rank, event))
                elif event["op"] == "recv":
                    queue = in_flight[(event["peer"], rank, event["tag"])]
                    if not queue:
                        break  # its send is not replayed yet: come back to this rank later
                    on_arrival(rank, event, queue.popleft())
                position[rank] += 1
                progress = True
