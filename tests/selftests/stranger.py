"""A process without the course's secret between a node and the head: issue 14's attack.

It answers where the node looks for the head (the rendezvous store names the
head's port, and anyone who reaches the store can rewrite it), relays the
handshake between the node and the real head both ways, so that each side's
proof reaches the other, and then, instead of the head's frames, sends the
node frames of its own: a ``run`` that asks for sandbox level ``none`` and
carries its own code, sealed as well as it can without the key.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import socket
import struct
import threading
from pathlib import Path

from grader import protocol, wire
from grader.nodes import pack_folder
from grader.wire import Frame

HANDSHAKE = 3  # challenge (head to node), join (node to head), accept (head to node)


def evil_run(code: Path) -> bytes:
    """A ``run`` frame at level ``none`` with ``code`` as the submission, in wire bytes."""

    class Capture:
        data = b""

        def sendall(self, data: bytes) -> None:
            self.data += bytes(data)

    frame = Frame(
        {"type": protocol.RUN, "world_size": 4, "level": "none", "device": "cpu"},
        [pack_folder(code)],
    )
    capture = Capture()
    wire.send_frame(capture, frame)  # type: ignore[arg-type]
    return capture.data


def forged_record(data: bytes, sequence: int = 0) -> bytes:
    """A record as the channel frames it, with a tag under a key the stranger made up."""
    length = struct.pack("!I", len(data))
    tag = hmac.new(b"a guess" * 4, struct.pack("!Q", sequence) + length + data, hashlib.sha256)
    return length + data + tag.digest()


class Stranger:
    """Listens on a port of its own; relays one node's handshake to ``head`` (host:port),
    then sends the node ``payload`` and drops what the head says (``relay``: the handshake
    is relayed; else the stranger answers the node's handshake itself, as a fake head)."""

    def __init__(self, head: str, payload: bytes, relay: bool = True) -> None:
        self.head, self.payload, self.relay = head, payload, relay
        self.listener = socket.create_server(("localhost", 0))
        self.port = self.listener.getsockname()[1]
        self.handshake_relayed = threading.Event()
        self._sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError, wire.WireError):
            node, _ = self.listener.accept()
            self._sockets.append(node)
            if self.relay:
                host, _, port = self.head.rpartition(":")
                head = socket.create_connection((host, int(port)))
                self._sockets.append(head)
                for source, target in [(head, node), (node, head), (head, node)][:HANDSHAKE]:
                    wire.send_frame(target, wire.recv_frame(source))
            else:  # a head of its own, which cannot make the head's proof
                wire.send_frame(node, Frame({"type": protocol.CHALLENGE, "nonce": "0" * 32}))
                wire.recv_frame(node)
                wire.send_frame(node, Frame({"type": protocol.ACCEPT, "proof": "0" * 64}))
            self.handshake_relayed.set()
            node.sendall(self.payload)
            while node.recv(1 << 16):  # until the node hangs up
                pass

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()
