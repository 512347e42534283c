"""Node 0's side of a run across nodes: the rendezvous store, the port, the other nodes' graders
(the package :mod:`grader.nodes` says how a run across nodes goes)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grader import protocol, wire
from grader.nodes import JOIN_SECONDS, Nodes, NodesError, channel
from grader.nodes.channel import Sealed
from grader.sandbox import Level
from grader.wire import Frame

PORT_KEY = "grader/port"

# What serves a rank's connection for the current job: Broker.serve (a Sealed reads like a
# socket).
Serve = Callable[[int, Sealed, bool], None]


@dataclass(frozen=True)
class _Job:
    """The job whose ranks may connect now: every node runs ``per_node`` of them."""

    id: str
    per_node: int
    serve: Serve


def _cut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


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
        self._store.set(PORT_KEY, str(self._listener.getsockname()[1]))
        self._cv = threading.Condition()
        self._links: dict[int, Sealed] = {}
        self.levels: dict[int, Level] = {}  # the sandbox level each node that is ready applies
        self._gone: dict[int, str] = {}  # why a node went; -1: a session was tampered with
        self._refused_proofs = 0
        self._job: _Job | None = None
        self._watcher: Callable[[str], None] | None = None  # the current job's broker
        self._finished = False
        threading.Thread(target=self._accept, daemon=True).start()

    def wait_for_nodes(self, timeout: float = JOIN_SECONDS) -> None:
        """Until every other node's grader joined; NodesError if one cannot."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while len(self.levels) < self.nodes.count - 1:
                if (problem := self.problem()) is not None:
                    raise NodesError(problem)
                if not self._cv.wait(max(0.0, deadline - time.monotonic())):
                    missing = sorted(set(range(1, self.nodes.count)) - set(self.levels))
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

    def watch(self, gone: Callable[[str], None]) -> None:
        """Call ``gone(why)`` when the run cannot go on across nodes (at once if it cannot
        already): the current job's broker hears of a node's end as of a rank's."""
        with self._cv:
            self._watcher = gone
            self._tell()

    def _went(self, node: int, why: str) -> None:
        """Node ``node`` went (-1: a session was tampered with), under the lock."""
        self._gone.setdefault(node, why)
        self._tell()
        self._cv.notify_all()

    def _tell(self) -> None:
        if self._watcher is not None and (why := self.problem()) is not None:
            self._watcher(why)

    def problem(self) -> str | None:
        """Why the run cannot go on across nodes (a node refused or went), if it cannot."""
        with self._cv:
            return next(iter(self._gone.values()), None)

    def start_job(self, job_id: str, per_node: int, serve: Serve) -> None:
        """Ranks of ``job_id`` may connect now; every node starts its agent for it."""
        with self._cv:
            self._job = _Job(job_id, per_node, serve)
            for node, link in self._links.items():
                if node in self.levels:  # a node not ready yet gets it when it is
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

    def _send_job(self, link: Sealed) -> None:
        if (job := self._job) is not None:
            self._send(link, Frame({"type": protocol.JOB, "id": job.id, "per_node": job.per_node}))

    def _send(self, link: Sealed, frame: Frame) -> None:
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
        """A newcomer proves itself (and the head to it); a node's grader or a rank's relay
        that did is served, in the session the handshake made."""
        channel.no_delay(sock)
        # One deadline for the whole handshake, not one per read: a trickle cannot hold it.
        deadline = threading.Timer(channel.HANDSHAKE_SECONDS, _cut, args=(sock,))
        deadline.start()
        try:
            session = channel.accept(sock, self.key, self._tampered)
        finally:
            deadline.cancel()
        if session is None:
            with self._cv:
                self._refused_proofs += 1
                self._cv.notify_all()
            return
        claim, link = session
        if claim.get("role") == "node":
            self._serve_node(link, claim.get("node"))
        elif claim.get("role") == "rank":
            self._serve_rank(link, claim.get("job"), claim.get("rank"))
        else:
            link.close()

    def _tampered(self, why: str) -> None:
        """A session's record failed its check: the run cannot be trusted, and ends."""
        with self._cv:
            self._went(-1, why)

    def _serve_rank(self, sock: Sealed, job: Any, rank: Any) -> None:
        with self._cv:
            current = self._job
        if (
            current is None
            or job != current.id
            or not isinstance(rank, int)
            or not 0 <= rank < self.world_size
        ):
            sock.close()  # a rank of a job that is over, or of none
            return
        current.serve(rank, sock, True)

    def _serve_node(self, sock: Sealed, node: Any) -> None:
        with self._cv:
            if not isinstance(node, int) or not 0 < node < self.nodes.count or node in self._links:
                sock.close()
                return
            self._links[node] = sock
            self._send(sock, self._run)
            self._cv.notify_all()
        said = f"node {node}'s grader stopped (or the connection to it broke)"
        try:
            while (frame := wire.recv_frame(sock)) is not None:
                kind = frame.header["type"]
                if kind == protocol.READY:
                    self._ready(sock, node, frame.header.get("level"))
                elif kind == protocol.REFUSE:
                    said = f"node {node}: {protocol.clean(frame.header.get('message', ''), 300)}"
        except (OSError, wire.WireError) as err:
            if isinstance(err, channel.TamperedError):
                said = f"node {node}: {err}"
        with self._cv:
            del self._links[node]
            if not self._finished:
                self._went(node, said)
            self._cv.notify_all()

    def _ready(self, sock: Sealed, node: int, level: Any) -> None:
        """Node ``node`` took the run at sandbox ``level``: it starts the current job too."""
        asked = self._run.header.get("level")
        with self._cv:
            if node in self.levels:
                return
            # A node lowers no level, and raises none the head did not ask.
            if level != asked or level not in {lv.value for lv in Level}:
                said = protocol.clean(level, 20)
                self._went(node, f"node {node} applies sandbox {said!r}, not {asked!r}")
            else:
                self.levels[node] = Level(level)
                self._send_job(sock)  # joined late: it starts the current job too
            self._cv.notify_all()
