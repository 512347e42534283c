"""Communication figures of a collective from the messages every rank logged, and their bounds.

The figures are deterministic: the same code sends the same messages on any
machine, so they can be graded on a noisy laptop. For p ranks and n bytes
(Thakur, Rabenseifner and Gropp 2005; Chan et al. 2007; MPICH's cost comments):

- some rank must move at least 2(p-1)/p n bytes in an all-reduce, (p-1)/p n
  in an all-gather, reduce-scatter, scatter, gather or all-to-all, and n in a
  broadcast or reduce (``BANDWIDTH_BOUND`` below);
- every collective needs at least ceil(log2 p) rounds, a round being one step
  of the longest chain of messages each of which waits for the one before
  (one-port model: a rank's sends go one after the other).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from grader.broker.traffic import Message
from grader.judge.replay import replay
from grader.protocol import OpName

# Bytes the busiest rank must send or receive, as a multiple of n, for p ranks.
BANDWIDTH_BOUND = {
    OpName.ALL_REDUCE: lambda p: 2 * (p - 1) / p,
    OpName.ALL_GATHER: lambda p: (p - 1) / p,
    OpName.REDUCE_SCATTER: lambda p: (p - 1) / p,
    OpName.ALL_TO_ALL: lambda p: (p - 1) / p,
    OpName.SCATTER: lambda p: (p - 1) / p,
    OpName.GATHER: lambda p: (p - 1) / p,
    OpName.BROADCAST: lambda p: 1.0,
    OpName.REDUCE: lambda p: 1.0,
}
# nccl-tests' bus bandwidth factors (busbw = algbw * factor) are these same ratios: busbw
# is the bandwidth a rank's link sees when the collective moves exactly the bound.
BUS_FACTOR = BANDWIDTH_BOUND


@dataclass(frozen=True)
class Figures:
    """What one implementation's messages cost, over all ranks."""

    busiest_bytes: int  # max over ranks of max(bytes sent, bytes received)
    busiest_rank: int
    messages: int
    rounds: int
    sent: list[int]
    received: list[int]

    def as_dict(self) -> dict[str, Any]:
        return {
            "busiest_bytes": self.busiest_bytes,
            "busiest_rank": self.busiest_rank,
            "messages": self.messages,
            "rounds": self.rounds,
            "bytes_sent": self.sent,
            "bytes_received": self.received,
        }


def figures(per_rank: list[list[Message]]) -> Figures:
    """Bytes, message count and rounds from every rank's logged events (program order)."""
    sent = [sum(e.nbytes for e in events if e.op is OpName.SEND) for events in per_rank]
    received = [sum(e.nbytes for e in events if e.op is OpName.RECV) for events in per_rank]
    traffic = [max(s, r) for s, r in zip(sent, received, strict=False)]
    busiest = max(range(len(traffic)), key=traffic.__getitem__) if traffic else 0
    messages = sum(1 for events in per_rank for e in events if e.op is OpName.SEND)
    return Figures(
        traffic[busiest] if traffic else 0,
        busiest,
        messages,
        count_rounds(per_rank),
        sent,
        received,
    )


def count_rounds(per_rank: list[list[Message]]) -> int:
    """The rounds of the longest chain of messages, each waiting for the one before.

    One-port, full-duplex model (each rank sends at most one message and
    receives at most one per round): a send leaves in the round after both the
    last message its rank received and its previous send; a message arrives in
    its send's round, or after its receiver's previous arrival.
    """
    ranks = len(per_rank)
    clock, last_send, last_arrival = [0] * ranks, [0] * ranks, [0] * ranks

    def on_send(rank: int, event: Message) -> float:
        last_send[rank] = max(clock[rank], last_send[rank]) + 1
        return last_send[rank]

    def on_arrival(rank: int, event: Message, sent_in: float) -> None:
        last_arrival[rank] = max(int(sent_in), last_arrival[rank] + 1)
        clock[rank] = max(clock[rank], last_arrival[rank])

    replay(per_rank, on_send, on_arrival)
    return max([*last_send, *last_arrival], default=0)


def bound_bytes(function: str, world_size: int, n_bytes: int) -> float:
    return BANDWIDTH_BOUND[function](world_size) * n_bytes


def moved(op: OpName, world_size: int, nbytes: int) -> float:
    """The bytes an operation moves on a rank at the bound, from the bytes the broker records
    for it (its first input, one rank's piece for a gather): a collective's bound of the whole
    n, a send's bytes, a receive's none (they count on the sending rank)."""
    if op in BANDWIDTH_BOUND:
        by_piece = op in (OpName.ALL_GATHER, OpName.GATHER)
        return bound_bytes(op, world_size, nbytes * world_size if by_piece else nbytes)
    return nbytes if op == OpName.SEND else 0


def min_rounds(world_size: int) -> int:
    return math.ceil(math.log2(world_size)) if world_size > 1 else 0
