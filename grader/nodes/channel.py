"""The authenticated channel between the nodes of a run: a mutual proof, then sealed records.

Every connection to the head's port (a node's grader, a rank's relay) opens
with a handshake in which each side proves that it holds the course's key,
over a nonce of each side, and both derive the keys of this one session::

    head -> peer   challenge  {nonce: Nh}
    peer -> head   join       {claim..., nonce: Np, proof: HMAC(K, "peer" | Nh, Np, claim)}
    head -> peer   accept     {proof: HMAC(K, "head" | Nh, Np, claim)}

The peer checks the head's proof too: a process without the key that answers
at the head's address (the rendezvous store is open to anyone who can reach
it) cannot pass as the head, and one that relays the real head's handshake
learns nothing it can use. Everything after the handshake travels as sealed
records, as TLS frames its records::

    !I length | data | HMAC-SHA256(direction's key, !Q sequence | !I length | data)

with a key for each direction, derived from K and both nonces, and a
sequence number for each direction: a record forged, altered, replayed from
another session, reordered or reflected fails its check, and the channel
ends with :class:`TamperedError`. :class:`Sealed` reads and writes like a
socket (``sendall``, ``recv_into``), so :mod:`grader.wire`'s frames travel
over it unchanged, and a frame's length is read only from checked bytes.

(``ssl`` has TLS with a pre-shared key only from Python 3.13 on, and an
``SSLSocket`` may not be read and written from two threads at once, as the
broker and the relays do; ``hmac`` needs neither.)
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any, NoReturn

from grader import protocol, wire
from grader.nodes import NodesError
from grader.wire import Frame

HANDSHAKE_SECONDS = 10.0
HANDSHAKE_BYTES = 64 << 10  # a challenge, a join, an accept: nothing big before the proof
RECORD_BYTES = 1 << 20  # the most a record holds: nothing larger is read before its check
_LENGTH = struct.Struct("!I")
_SEQUENCE = struct.Struct("!Q")
_TAG = hashlib.sha256().digest_size
_SMALL = 64 << 10
_NONCE_CHARS = 32


class TamperedError(ConnectionError):
    """A record failed its check: someone between the nodes forged or altered it."""


def _mac(key: bytes, label: str, *parts: Any) -> bytes:
    message = json.dumps([label, *parts], sort_keys=True, separators=(",", ":"))
    return hmac.new(key, message.encode(), hashlib.sha256).digest()


def _nonce(header: dict[str, Any]) -> str | None:
    nonce = header.get("nonce")
    return nonce if isinstance(nonce, str) and len(nonce) == _NONCE_CHARS else None


def no_delay(sock: socket.socket) -> None:
    """Frames go out at once: Nagle's algorithm would hold a small one back for an ACK that
    the peer delays (40 ms a message, which made a call across nodes 8 times slower)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Sealed:
    """One side of an authenticated session: a socket whose every byte is checked."""

    def __init__(
        self,
        sock: socket.socket,
        send_key: bytes,
        recv_key: bytes,
        on_tamper: Callable[[str], None] = lambda why: None,
    ) -> None:
        self.sock = sock
        self._send_key, self._recv_key = send_key, recv_key
        self._on_tamper = on_tamper
        self._send_lock = threading.Lock()  # the broker and a relay write from several threads
        self._sent = self._received = 0
        self._plain, self._offset = memoryview(b""), 0  # a checked record, and how far read

    def _tag(self, key: bytes, sequence: int, length: bytes, data: memoryview) -> bytes:
        mac = hmac.new(key, _SEQUENCE.pack(sequence) + length, hashlib.sha256)
        mac.update(data)
        return mac.digest()

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        with self._send_lock:
            for start in range(0, max(len(view), 1), RECORD_BYTES):
                chunk = view[start : start + RECORD_BYTES]
                length = _LENGTH.pack(len(chunk))
                tag = self._tag(self._send_key, self._sent, length, chunk)
                self._sent += 1
                if len(chunk) < _SMALL:  # one packet
                    self.sock.sendall(length + bytes(chunk) + tag)
                else:  # no copy
                    for part in (length, chunk, tag):
                        self.sock.sendall(part)

    def recv_into(self, buffer: memoryview, nbytes: int = 0) -> int:
        """Up to ``nbytes`` checked bytes into ``buffer``; 0 when the peer ended the session."""
        nbytes = nbytes or len(buffer)
        while self._offset == len(self._plain):
            if not self._next_record():
                return 0
        n = min(nbytes, len(self._plain) - self._offset)
        buffer[:n] = self._plain[self._offset : self._offset + n]
        self._offset += n
        return n

    def _next_record(self) -> bool:
        """Read and check one record; False at a clean end between records."""
        length = bytearray(_LENGTH.size)
        if not self._read_into(memoryview(length), eof_ok=True):
            return False
        (size,) = _LENGTH.unpack(length)
        if size > RECORD_BYTES:
            self._tampered(f"a record of {size} bytes, over the limit")
        body = memoryview(bytearray(size + _TAG))
        self._read_into(body)
        data, tag = body[:size], body[size:]
        if not hmac.compare_digest(tag, self._tag(self._recv_key, self._received, length, data)):
            self._tampered(f"record {self._received} failed its integrity check")
        self._received += 1
        self._plain, self._offset = data, 0
        return True

    def _read_into(self, view: memoryview, eof_ok: bool = False) -> bool:
        """Fill ``view`` from the socket; False if it ended before the first byte."""
        got = 0
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if n == 0:
                if eof_ok and got == 0:
                    return False
                raise ConnectionError("the connection ended in the middle of a record")
            got += n
        return True

    def _tampered(self, why: str) -> NoReturn:
        message = f"{why}: the connection between the nodes was tampered with"
        self._on_tamper(message)
        raise TamperedError(message)

    # What else the broker and the relays do with a connection.
    def settimeout(self, seconds: float | None) -> None:
        self.sock.settimeout(seconds)

    def shutdown(self, how: int) -> None:
        self.sock.shutdown(how)

    def close(self) -> None:
        self.sock.close()


def _session(key: bytes, head_nonce: str, peer_nonce: str, claim: dict[str, Any]) -> dict:
    """The proofs and the keys of one session (peer to head, head to peer)."""
    said = (head_nonce, peer_nonce, claim)
    return {
        "peer": _mac(key, "peer proves", *said).hex(),
        "head": _mac(key, "head proves", *said).hex(),
        "up": _mac(key, "peer to head", *said),
        "down": _mac(key, "head to peer", *said),
    }


def connect(address: str, key: bytes, claim: dict[str, Any]) -> Sealed:
    """A session with the head at ``address`` (host:port), for ``claim``; NodesError if the
    head turns it away or does not prove that it holds ``key`` itself."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=HANDSHAKE_SECONDS)
    no_delay(sock)
    try:
        challenge = wire.recv_frame(sock, HANDSHAKE_BYTES)
        if challenge is None or challenge.header["type"] != protocol.CHALLENGE:
            raise NodesError(f"{address} is not a grader's head")
        head_nonce, mine = _nonce(challenge.header), secrets.token_hex(_NONCE_CHARS // 2)
        if head_nonce is None:
            raise NodesError(f"{address} is not a grader's head")
        session = _session(key, head_nonce, mine, claim)
        join = {"type": protocol.JOIN, **claim, "nonce": mine, "proof": session["peer"]}
        wire.send_frame(sock, Frame(join))
        accept = wire.recv_frame(sock, HANDSHAKE_BYTES)
        if accept is None:
            raise NodesError(
                f"the head at {address} turned this away: is $GRADER_SECRET the same on every node?"
            )
        proof = accept.header.get("proof")
        if accept.header["type"] != protocol.ACCEPT or not (
            isinstance(proof, str) and hmac.compare_digest(proof, session["head"])
        ):
            raise NodesError(
                f"{address} did not prove that it holds the course's secret: it is no head "
                "of this course (someone else answers at the address the rendezvous names)"
            )
    except (OSError, wire.WireError, NodesError) as err:
        sock.close()
        if isinstance(err, NodesError):
            raise
        raise NodesError(f"the handshake with {address} failed: {err}") from None
    sock.settimeout(None)
    return Sealed(sock, session["up"], session["down"])


def accept(
    sock: socket.socket, key: bytes, on_tamper: Callable[[str], None]
) -> tuple[dict[str, Any], Sealed] | None:
    """The head's side of the handshake: the peer's claim and the session, or None if the
    peer did not prove itself (``sock`` is closed then). The caller bounds its time."""
    mine = secrets.token_hex(_NONCE_CHARS // 2)
    try:
        wire.send_frame(sock, Frame({"type": protocol.CHALLENGE, "nonce": mine}))
        join = wire.recv_frame(sock, HANDSHAKE_BYTES)
    except (OSError, wire.WireError):
        join = None
    header = join.header if join is not None and join.header["type"] == protocol.JOIN else {}
    claim = {k: v for k, v in header.items() if k not in ("type", "nonce", "proof")}
    peer_nonce, proof = _nonce(header), header.get("proof")
    if peer_nonce is not None and isinstance(proof, str):
        session = _session(key, mine, peer_nonce, claim)
        if hmac.compare_digest(proof, session["peer"]):
            with contextlib.suppress(OSError):
                wire.send_frame(sock, Frame({"type": protocol.ACCEPT, "proof": session["head"]}))
                return claim, Sealed(sock, session["down"], session["up"], on_tamper)
    sock.close()
    return None
