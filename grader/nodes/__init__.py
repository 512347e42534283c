"""Graded jobs larger than one machine: the head, the nodes that lend it ranks, the proof.

    node 0:  grader run [PART ...] --nnodes 2 --node-rank 0 --rdzv-endpoint HEAD:29400
    node 1:  grader run --nnodes 2 --node-rank 1 --rdzv-endpoint HEAD:29400

Node 0, the head, grades: it runs the graded tests and the broker, and hosts
at HEAD:PORT the store in which torchrun's agents meet (torchrun's c10d
rendezvous; the head's own agent is one of them). Every other node lends
ranks: its grader joins the head, receives the staged submission and the
sandbox level, and for each job the head starts, starts an agent of its own
in the same rendezvous. Each rank reaches the broker through its trusted
relay (:mod:`grader.nodes.relay`). Which global ranks land on which node is
torchrun's choice.

Supervision reads no other machine's /proc or files:

- a node's grader stays connected to the head for the whole run, so the head
  knows at once when a node goes, and a node whose head goes ends its ranks;
- a rank's relay tells the broker how the rank's process ended, and its last
  output; its stack is asked of the rank through the broker, as on one machine;
- the head ends a job by closing the broker: each relay then kills its rank,
  and each node's agent ends with its ranks.

Everything between nodes passes through one TCP port of the head, which the
rendezvous store names, in sessions of :mod:`grader.nodes.channel`: the head
and whoever connects there each prove that they hold a key made from the
course's secret (which the ranks cannot read), and every frame after that is
checked. The head listens to no one else, and a node obeys no one else.

No setting of the sandbox is taken from the network: each node grades at its
own level (its own ``--sandbox``, or the best it has), and refuses a head
that asks for less; each node says the level it applied, and results.json
records them.

The rooms: :mod:`grader.nodes.head` (node 0's side), :mod:`grader.nodes.lend` (every other
node's), :mod:`grader.nodes.relay` (a rank's way to the head), :mod:`grader.nodes.channel`
(the proof and the sealed records); this module holds what they share: where a grader
stands in the run (:class:`Nodes`), the key, the submission as it travels.
"""

from __future__ import annotations

import io
import tarfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["JOIN_SECONDS", "Nodes", "NodesError", "node_key", "pack_folder", "unpack_folder"]

JOIN_SECONDS = 600.0  # how long the head waits for the other nodes, and they for the head


class NodesError(Exception):
    """The nodes cannot form one run (bad options, a wrong secret, a node gone); one line."""


@dataclass(frozen=True)
class Nodes:
    """Where this grader stands in a run across nodes (``--nnodes/--node-rank/--rdzv-endpoint``)."""

    count: int
    rank: int
    host: str
    port: int

    @property
    def head(self) -> bool:
        return self.rank == 0

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def from_options(
        cls, nnodes: int | None, node_rank: int | None, endpoint: str | None
    ) -> Nodes | None:
        """The options merged into one value; None for a run on this machine alone."""
        if nnodes is None and node_rank is None and endpoint is None:
            return None
        if nnodes is None or nnodes < 1:
            raise NodesError("--nnodes N (N >= 1) says how many nodes the job spans")
        if nnodes == 1 and not node_rank:
            return None
        if node_rank is None or not 0 <= node_rank < nnodes:
            raise NodesError(
                f"--node-rank R must be in 0..{nnodes - 1} (0 is the node that grades)"
            )
        host, _, port = (endpoint or "").rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise NodesError(
                "--rdzv-endpoint HOST:PORT (node 0's address, and a free port there) is needed "
                "with --nnodes"
            )
        return cls(nnodes, node_rank, host.strip("[]"), int(port))

    def per_node(self, world_size: int) -> int:
        if world_size % self.count:
            raise NodesError(
                f"--nnodes {self.count} does not divide the job's {world_size} ranks "
                "(the largest world size graded): every node runs as many"
            )
        return world_size // self.count


def node_key() -> bytes:
    from grader.course.secret import derive

    return derive("grader nodes")


def pack_folder(folder: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        archive.add(folder, arcname=folder.name)
    return buffer.getvalue()


def unpack_folder(data: bytes, into: Path) -> None:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        archive.extractall(into, filter="data")
