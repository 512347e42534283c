"""What a recorded message pattern would cost on a real machine (an alpha-beta model).

The pattern a student's code produced on a laptop is replayed on a model of
a machine (``machines.yaml``): each message costs alpha + bytes / bandwidth
on the link between its ranks, a rank sends one message at a time, and a
receive completes when its message has arrived. The projected time is when
the last rank finishes. A laptop student learns whether their algorithm
would scale: a gather-then-broadcast all-reduce that ties with a ring here
is p/2 times slower on eight GPUs.

The ranks' local work (:meth:`grader.broker.traffic.Traffic.local_work`), timed
on this machine's CPU, can be replayed with the messages: each rank spends it
before the operation it delayed. On :data:`LOCAL_WORK`, whose links cost
nothing, that replay is the local work's critical path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

from grader.broker.traffic import Message, RankWork
from grader.judge.replay import replay

MACHINES_FILE = Path(__file__).with_name("machines.yaml")


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds
    beta: float  # seconds per byte

    def cost(self, nbytes: int) -> float:
        return self.alpha + nbytes * self.beta


@dataclass(frozen=True)
class Machine:
    name: str
    description: str
    source: str
    ranks_per_node: int | str
    node: Link | None
    network: Link | None

    def link(self, a: int, b: int, world_size: int) -> Link:
        per_node = self.ranks_per_node
        if per_node == "half":
            per_node = max(1, world_size // 2)
        same_node = a // int(per_node) == b // int(per_node)
        link = self.node if same_node else self.network
        return link or self.network or self.node  # type: ignore[return-value]


FREE = Link(0.0, 0.0)


@cache
def machines() -> tuple[Machine, ...]:
    raw = yaml.safe_load(MACHINES_FILE.read_text())["machines"]
    return tuple(
        Machine(
            name,
            body["description"],
            body["source"],
            body["ranks_per_node"],
            _link(body.get("node")),
            _link(body.get("network")),
        )
        for name, body in raw.items()
    )


def _link(raw: dict[str, float] | None) -> Link | None:
    if raw is None:
        return None
    return Link(raw["alpha_us"] * 1e-6, 1.0 / (raw["bandwidth_GBps"] * 1e9))


#: Links that cost nothing: a replay on it is the critical path of the local work alone.
LOCAL_WORK = Machine(
    "local work", "the ranks' local work alone, on links that cost nothing", "", 1, FREE, FREE
)


def project(
    per_rank: list[list[Message]], machine: Machine, work: Sequence[RankWork] = ()
) -> float:
    """Seconds until the last rank is done, replaying the logged messages on ``machine``;
    with ``work``, each rank also spends its local work where it was measured to."""
    world_size = len(per_rank)
    clock = [0.0] * world_size  # when the rank may next act
    port_free = [0.0] * world_size  # when its outgoing link is free again
    if work and [len(w.before) for w in work] != [len(log) for log in per_rank]:
        raise ValueError("the local work is not of these message logs")

    def before(rank: int, index: int) -> None:
        clock[rank] += work[rank].before[index]

    def on_send(rank: int, event: Message) -> float:
        start = max(clock[rank], port_free[rank])
        port_free[rank] = start + machine.link(rank, event.peer, world_size).cost(event.nbytes)
        return port_free[rank]

    def on_arrival(rank: int, event: Message, arrives: float) -> None:
        clock[rank] = max(clock[rank], arrives)

    replay(per_rank, on_send, on_arrival, before if work else None)
    for rank, done in enumerate(work):
        clock[rank] += done.tail
    return max([*clock, *port_free], default=0.0)
