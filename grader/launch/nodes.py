"""Graded jobs larger than one machine: the head, the nodes that lend it ranks, the proof.

    node 0:  grader run [PART ...] --nnodes 2 --node-rank 0 --rdzv-endpoint HEAD:29400
    node 1:  grader run --nnodes 2 --node-rank 1 --rdzv-endpoint HEAD:29400

Node 0, the head, grades: it runs the graded tests and the broker, and hosts
at HEAD:PORT the store in which torchrun's agents meet (torchrun's c10d
rendezvous; the head's own agent is one of them). Every other node lends
ranks: its grader joins the head, receives the staged submission and the
sandbox level, and for each job the head starts, starts an agent of its own
in the same rendezvous. Each rank reaches the broker through its trusted
relay (:mod:`grader.launch.relay`). Which global ranks land on which node is
torchrun's choice.

Supervision reads no other machine's /proc or files:

- a node's grader stays connected to the head for the whole run, so the head
  knows at once when a node goes, and a node whose head goes ends its ranks;
- a rank's relay tells the broker how the rank's process ended, and its last
  output; its stack is asked of the rank through the broker, as on one machine;
- the head ends a job by closing the broker: each relay then kills its rank,
  and each node's agent ends with its ranks.

Everything between nodes passes through one TCP port of the head, which the
rendezvous store names. Whoever connects there answers a fresh challenge
with an HMAC made from the course's secret (which the ranks cannot read);
the head listens to no one else.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import io
import json
import secrets
import socket
import tarfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from grader import protocol, wire
from grader.options import Nodes, NodesError
from grader.wire import Frame

JOIN_SECONDS = 600.0  # how long the head waits for the other nodes, and they for the head
_HANDSHAKE_SECONDS = 10.0
_HANDSHAKE_BYTES = 64 << 10  # a challenge or a join: nothing big is read before the proof
_PORT_KEY = "grader/port"

# What serves a rank's connection for the current job: Broker.serve.
Serve = Callable[[int, socket.socket, bool], None]


def node_key() -> bytes:
    from grader.secret import derive

    return derive("grader nodes")


# -- the proof -------------------------------------------------------------------------------


def _proof(key: bytes, nonce: str, claim: dict[str, Any]) -> str:
    message = nonce + json.dumps(claim, sort_keys=True)
    return hmac.new(key, message.encode(), hashlib.sha256).hexdigest()


def connect(address: str, key: bytes, claim: dict[str, Any]) -> socket.socket:
    """A connection to the head at ``address`` that answered its challenge for ``claim``."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=_HANDSHAKE_SECONDS)
    _no_delay(sock)
    challenge = wire.recv_frame(sock, _HANDSHAKE_BYTES)
    if challenge is None or challenge.header["type"] != protocol.CHALLENGE:
        sock.close()
        raise NodesError(f"{address} is not a grader's head")
    proof = _proof(key, str(challenge.header.get("nonce")), claim)
    wire.send_frame(sock, Frame({"type": protocol.JOIN, **claim, "proof": proof}))
    sock.settimeout(None)
    return sock


def _cut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _no_delay(sock: socket.socket) -> None:
    """Frames go out at once: Nagle's algorithm would hold a small one back for an ACK that
    the peer delays (40 ms a message, which made a call across nodes 8 times slower)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# -- the head --------------------------------------------------------------------------------


class Head:
    """Node 0's side: the rendezvous store, the port, the other nodes' graders."""

    def __init__(self, nodes: Nodes, key: bytes, world_size: int, run: Frame) -> None:
        import torch.distributed as dist

        self.nodes = nodes
        self.world_size = world_size
        self.key = key
        self._run = run
        try:  # torchrun's agents (this node's too) rendezvous in it, as clients
            self._store = dist.TCPStore(
                nodes.host, nodes.port, is_master=True, wait_for_workers=False
            )
        except (RuntimeError, ValueError) as err:
            raise NodesError(f"cannot host the rendezvous at {nodes.endpoint}: {err}") from None
        self._listener = socket.create_server(("", 0))
        self.address = f"{nodes.host}:{self._listener.getsockname()[1]}"
        self._store.set(_PORT_KEY, str(self._listener.getsockname()[1]))
        self._cv = threading.Condition()
        self._links: dict[int, socket.socket] = {}
        self._gone: dict[int, str] = {}
        self._refused_proofs = 0
        self._job: tuple[str, int, Serve] | None = None  # id, ranks per node, its broker
        self._finished = False
        threading.Thread(target=self._accept, daemon=True).start()

    def wait_for_nodes(self, timeout: float = JOIN_SECONDS) -> None:
        """Until every other node's grader joined; NodesError if one cannot."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while len(self._links) < self.nodes.count - 1:
                if (problem := self.problem()) is not None:
                    raise NodesError(problem)
                if not self._cv.wait(max(0.0, deadline - time.monotonic())):
                    missing = sorted(set(range(1, self.nodes.count)) - set(self._links))
                    hint = (
                        f"; {self._refused_proofs} connection(s) failed the proof: is "
                        "$GRADER_SECRET the same on every node?"
                        if self._refused_proofs
                        else ""
                    )
                    raise NodesError(
                        f"node(s) {', '.join(map(str, missing))} did not join within "
                        f"{timeout:.0f} s: run `grader run --nnodes {self.nodes.count} "
                        f"--node-rank R --rdzv-endpoint {self.nodes.endpoint}` on each{hint}"
                    )

    def problem(self) -> str | None:
        """Why the run cannot go on across nodes (a node refused or went), if it cannot."""
        with self._cv:
            return next(iter(self._gone.values()), None)

    def start_job(self, job_id: str, per_node: int, serve: Serve) -> None:
        """Ranks of ``job_id`` may connect now; every node starts its agent for it."""
        with self._cv:
            self._job = (job_id, per_node, serve)
            for link in self._links.values():
                self._send_job(link)

    def finish(self) -> None:
        """Grading is over: the nodes end their ranks and leave; then the port and store go."""
        with self._cv:
            self._finished = True
            self._job = None
            for link in self._links.values():
                self._send(link, Frame({"type": protocol.FINISH}))
            deadline = time.monotonic() + 10
            while self._links and self._cv.wait(max(0.0, deadline - time.monotonic())):
                pass
            for link in self._links.values():
                link.close()
        self._listener.close()
        del self._store

    def _send_job(self, link: socket.socket) -> None:
        if self._job is not None:
            job_id, per_node, _ = self._job
            self._send(link, Frame({"type": protocol.JOB, "id": job_id, "per_node": per_node}))

    def _send(self, link: socket.socket, frame: Frame) -> None:
        with contextlib.suppress(OSError):  # the link's reader sees it end, and says so
            wire.send_frame(link, frame)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._welcome, args=(sock,), daemon=True).start()

    def _welcome(self, sock: socket.socket) -> None:
        """Challenge a newcomer; a node's grader or a rank's relay that proves itself is served."""
        nonce = secrets.token_hex(16)
        _no_delay(sock)
        # One deadline for the whole handshake, not one per read: a trickle cannot hold it.
        deadline = threading.Timer(_HANDSHAKE_SECONDS, _cut, args=(sock,))
        deadline.start()
        try:
            wire.send_frame(sock, Frame({"type": protocol.CHALLENGE, "nonce": nonce}))
            join = wire.recv_frame(sock, _HANDSHAKE_BYTES)
        except (OSError, wire.WireError):
            join = None
        finally:
            deadline.cancel()
        if join is None:
            sock.close()
            return
        header = join.header
        claim = {k: v for k, v in header.items() if k not in ("type", "proof")}
        proof = str(header.get("proof", ""))
        if not header or not hmac.compare_digest(proof, _proof(self.key, nonce, claim)):
            with self._cv:
                self._refused_proofs += 1
                self._cv.notify_all()
            sock.close()
            return
        if claim.get("role") == "node":
            self._serve_node(sock, claim.get("node"))
        elif claim.get("role") == "rank":
            self._serve_rank(sock, claim.get("job"), claim.get("rank"))
        else:
            sock.close()

    def _serve_rank(self, sock: socket.socket, job: Any, rank: Any) -> None:
        with self._cv:
            current = self._job
        if (
            current is None
            or job != current[0]
            or not isinstance(rank, int)
            or not 0 <= rank < self.world_size
        ):
            sock.close()  # a rank of a job that is over, or of none
            return
        current[2](rank, sock, True)

    def _serve_node(self, sock: socket.socket, node: Any) -> None:
        with self._cv:
            if not isinstance(node, int) or not 0 < node < self.nodes.count or node in self._links:
                sock.close()
                return
            self._links[node] = sock
            self._send(sock, self._run)
            self._send_job(sock)  # joined late: it starts the current job too
            self._cv.notify_all()
        said = f"node {node}'s grader stopped (or the connection to it broke)"
        try:
            while (frame := wire.recv_frame(sock)) is not None:
                if frame.header["type"] == protocol.REFUSE:
                    said = f"node {node}: {protocol.clean(frame.header.get('message', ''), 300)}"
        except (OSError, wire.WireError):
            pass
        with self._cv:
            del self._links[node]
            if not self._finished:
                self._gone.setdefault(node, said)
            self._cv.notify_all()


# -- a node that lends ranks -----------------------------------------------------------------


def join_head(nodes: Nodes, key: bytes, timeout: float = JOIN_SECONDS) -> tuple[socket.socket, str]:
    """This node's grader, connected to the head (which may start after it), and the head's
    port, where this node's relays connect too."""
    import torch.distributed as dist

    deadline = time.monotonic() + timeout
    while True:  # quietly: torch's store client prints a trace for every failed try
        try:
            socket.create_connection((nodes.host, nodes.port), timeout=5).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise NodesError(
                    f"no head at {nodes.endpoint} within {timeout:.0f} s: start node 0 "
                    "(`grader run ... --node-rank 0`) there"
                ) from None
            time.sleep(0.5)
    store = dist.TCPStore(nodes.host, nodes.port, is_master=False, timeout=timedelta(seconds=60))
    port = store.get(_PORT_KEY).decode()
    del store
    address = f"{nodes.host}:{port}"
    return connect(address, key, {"role": "node", "node": nodes.rank}), address


# -- the submission, as it travels to the other nodes ------------------------------------------


def pack_folder(folder: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        archive.add(folder, arcname=folder.name)
    return buffer.getvalue()


def unpack_folder(data: bytes, into: Path) -> None:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        archive.extractall(into, filter="data")
