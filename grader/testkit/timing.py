"""Each pipeline stage's forward, backward and idle time, from the broker's clock alone.

The broker stamps every operation a rank posts (:attr:`Event.posted`). A message is
handed over when its send and its receive are both posted, so a stage that posted a
receive waits until the matching send is posted (and a send until its receive: blocking
semantics), and works from then until it posts its next operation. What that work was
follows from the messages around it: after an activation from stage ``r - 1`` arrives
(or, on the first stage, before an activation is sent) it is a forward; after a gradient
from stage ``r + 1`` arrives, a backward; the last stage's loss joins the two. The
scenario's marks bound the step. It is a picture, not a verdict: an ``isend`` waited
later than it was posted shows as waiting, and nothing here grades anything.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import asdict, dataclass

from grader.broker.traffic import Event, Traffic
from grader.protocol import OpName

FORWARD, BACKWARD, BOTH, OTHER, IDLE = "forward", "backward", "forward+backward", "other", "idle"


@dataclass(frozen=True)
class Segment:
    """One stretch of a stage's time, in seconds from the step's start."""

    kind: str  # FORWARD, BACKWARD, BOTH (the last stage's), OTHER (bookkeeping) or IDLE
    label: str  # "F3", "B3", "F3+B3", or ""
    start: float
    end: float


def matched_at(traffic: Traffic) -> dict[int, float]:
    """When each message was handed over, by ``id`` of its send and of its receive events."""
    sends: dict[tuple[int, int, int], deque[Event]] = defaultdict(deque)
    recvs: dict[tuple[int, int, int], deque[Event]] = defaultdict(deque)
    for rank, events in enumerate(traffic.per_rank):
        for e in events:
            if e.op == OpName.SEND:
                sends[(rank, e.peer, e.tag)].append(e)
            elif e.op == OpName.RECV:
                recvs[(e.peer, rank, e.tag)].append(e)
    at = {}
    for key, queue in sends.items():
        for send, recv in zip(queue, recvs.get(key, ()), strict=False):
            at[id(send)] = at[id(recv)] = max(send.posted, recv.posted)
    return at


def stage_timing(traffic: Traffic) -> list[list[dict]]:
    """Every stage's segments (as dicts, for results.json), from the first stage's start."""
    at = matched_at(traffic)
    stamps = [e.posted for events in traffic.per_rank for e in events]
    if not stamps:
        return [[] for _ in traffic.per_rank]
    origin = min(stamps)
    return [
        [asdict(s) for s in _stage(events, rank, len(traffic.per_rank), at, origin)]
        for rank, events in enumerate(traffic.per_rank)
    ]


def _stage(
    events: list[Event], rank: int, p: int, at: dict[int, float], origin: float
) -> list[Segment]:
    segments: list[Segment] = []
    cursor: float | None = None
    arrived: tuple[str, int] | None = None  # the message whose arrival started the work
    counts = {"forward": 0, "backward": 0, "activation": 0, "gradient": 0}

    def work(until: float, next_op: Event | None) -> None:
        if cursor is None or until <= cursor:
            return
        sends_to = next_op.peer if next_op is not None and next_op.op == OpName.SEND else None
        forwards, backwards = counts["forward"], counts["backward"]
        kind, label = OTHER, ""
        if arrived is not None and arrived[0] == "gradient":
            kind, label = BACKWARD, f"B{arrived[1]}"
        elif arrived is not None and sends_to == rank - 1:  # the last stage: loss, then back
            kind, label = BOTH, f"F{arrived[1]}+B{backwards}"
        elif arrived is not None:
            kind, label = FORWARD, f"F{arrived[1]}"
        elif sends_to == rank + 1:
            kind, label = FORWARD, f"F{forwards}"
        elif sends_to == rank - 1:
            kind, label = BACKWARD, f"B{backwards}"
        segments.append(Segment(kind, label, cursor - origin, until - origin))

    for e in events:
        if e.op == OpName.MARK:
            if cursor is not None:
                work(e.posted, None)
            cursor = e.posted if cursor is None else max(cursor, e.posted)
            continue
        if e.op not in (OpName.SEND, OpName.RECV):
            continue
        work(e.posted, e)
        cursor = e.posted if cursor is None else max(cursor, e.posted)
        if e.op == OpName.SEND:
            counts["forward" if e.peer == rank + 1 else "backward"] += 1
            arrived = None
        done = at.get(id(e))
        if done is None:  # never matched: the stage waited until the end
            break
        if done > cursor:
            segments.append(Segment(IDLE, "", cursor - origin, done - origin))
            cursor = done
        if e.op == OpName.RECV:
            what = "activation" if e.peer == rank - 1 else "gradient"
            arrived = (what, counts[what])
            counts[what] += 1
    return segments
