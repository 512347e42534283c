"""The faults the broker sees by looking at every rank at once, and how each is told.

Pure functions of the broker's state: which ranks are blocked in what, and
which messages are still queued. The broker records what they find and
refuses the operations involved.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence

from grader.broker.ops import Op, RankState
from grader.protocol import OpName

Queues = dict[tuple[int, int, int], deque[Op]]


def deadlock(states: Sequence[RankState]) -> str | None:
    """No rank can make progress: every live rank is blocked or has returned, one blocked.

    A rank waiting on a peer that has returned waits for what that peer will never post:
    the wait says so, since the peer's missing send (or receive) is the bug to look for.
    """
    live = [r for r in states if r.alive]
    if any(r.outcome is None and r.blocked_on is None for r in live):
        return None
    blocked = [r for r in live if r.blocked_on is not None]
    if not blocked:
        return None
    finished = {r.rank for r in live if r.outcome is not None}
    waits = [f"rank {r.rank} waits in {_wait(r.blocked_on, finished)}" for r in blocked]  # type: ignore[arg-type]
    named = {r.blocked_on.peer for r in blocked if r.blocked_on.kind in _NEVER}  # type: ignore[union-attr]
    done = [str(r) for r in sorted(finished - named)]
    returned = f" ({'rank' if len(done) == 1 else 'ranks'} {', '.join(done)} returned)"
    return "deadlock: " + " while ".join(waits) + (returned if done else "")


_NEVER = {OpName.RECV: "sending", OpName.SEND: "receiving"}  # what a returned peer never did


def _wait(op: Op, finished: set[int]) -> str:
    if op.kind not in _NEVER or op.peer not in finished:
        return op.describe()
    return f"{op.describe()}, but rank {op.peer} returned without {_NEVER[op.kind]} it"


def leftovers(sends: Queues, recvs: Queues) -> Iterator[tuple[Op, str, str]]:
    """Each send never received and receive never matched, in rank order (the same text
    every run): the op, the fault's message, and what its rank is told."""
    for _, queue in sorted(sends.items()):
        for op in queue:
            yield (
                op,
                f"rank {op.rank} sent {len(op.payload[0])} bytes to rank {op.peer} "
                f"(tag {op.tag}, at {op.at or '?'}) that rank {op.peer} never received",
                "never received",
            )
    for _, queue in sorted(recvs.items()):
        for op in queue:
            yield (
                op,
                f"rank {op.rank} posted a receive from rank {op.peer} (at {op.at or '?'}) "
                "that no message matched",
                "no message matched this receive",
            )


def never_waited(ops: Iterable[Op]) -> Iterator[str]:
    """Each request that completed but that its rank never waited for, in rank order.

    On NCCL an ``isend`` not waited may see its buffer reused before it is sent, and a
    receive's data is only there once it is waited for (here too: the broker hands a message
    to its rank when the rank waits, ``is_completed()`` or ``get_future()`` included).
    """
    unwaited = [op for op in ops if not (op.waited or op.refused)]
    for op in sorted(unwaited, key=lambda op: (op.rank, op.id)):
        where = f" at {op.at or '?'}"
        if op.kind == OpName.SEND:
            yield (
                f"rank {op.rank}: the isend to rank {op.peer}{where} was never waited: call "
                ".wait() on its request before the function returns (on NCCL its buffer may "
                "be reused before it is sent)"
            )
        elif op.kind == OpName.RECV:
            yield (
                f"rank {op.rank}: the irecv from rank {op.peer}{where} was never waited, so "
                "its data never arrived: call .wait() on its request before using the tensor"
            )
        else:
            yield (
                f"rank {op.rank}: the {op.kind}{where} (async_op=True) was never waited: "
                "call .wait() on its handle before using the result"
            )
