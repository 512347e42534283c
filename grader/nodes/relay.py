"""A rank's trusted relay to the head's broker, when a job spans nodes (run by its wrapper).

The rank's sandbox has no network: the rank speaks on the connection its wrapper
handed it, as on one machine, whose other end is the relay's. The relay, outside
the sandbox, connects to the head once the rank has spoken (so that "connected"
means the same as on one machine: the rank is up), it and the head prove themselves to each other
(:func:`grader.nodes.channel.connect`), and it passes frames both ways
unchanged, in the session's sealed records. It adds what only it knows: how the
rank's process ended (``exited``), and that the rank's bytes broke the format
(``broken``). A frame of those types from the rank is renamed on the way, so
the broker reads it as the unknown message it is.

When the broker closes the connection (the head ends the job), the relay
kills its rank.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import threading
from collections.abc import Callable

from grader import protocol, wire
from grader.nodes import NodesError
from grader.nodes.channel import Sealed, connect
from grader.protocol import RankExit
from grader.wire import Frame


class Relay:
    def __init__(
        self, worker: socket.socket, child: subprocess.Popen[bytes], address: str, key: bytes
    ) -> None:
        self.worker = worker
        self.child = child
        self.address = address
        self.key = key
        self._send_lock = threading.Lock()

    def run(self, job: str, rank: int, last_words: Callable[[], str]) -> int:
        """Relay until the rank's process ends; return its exit code."""
        worker = self._accept_worker()
        try:
            broker = connect(self.address, self.key, {"role": "rank", "job": job, "rank": rank})
        except (OSError, NodesError):  # the head is gone: so is the job
            self._kill()
            return self.child.wait()
        up = None
        if worker is not None:
            up = threading.Thread(target=self._up, args=(worker, broker), daemon=True)
            up.start()
            threading.Thread(target=self._down, args=(broker, worker), daemon=True).start()
        code = self.child.wait()
        if up is not None:
            up.join(timeout=2)  # the rank's last frames first (a daemon may hold its socket)
        ended = RankExit(code, last_words())
        with contextlib.suppress(OSError):
            self._to_broker(broker, Frame({"type": protocol.EXITED, **ended.to_wire()}))
            broker.shutdown(socket.SHUT_RDWR)
        broker.close()
        return code

    def _accept_worker(self) -> socket.socket | None:
        """The rank's connection once the rank has spoken on it; None if its process ended
        first (the rank holds the only other end: its end wakes the wait)."""
        try:
            spoken = self.worker.recv(1, socket.MSG_PEEK)
        except OSError:
            spoken = b""
        if not spoken:
            self.worker.close()
            return None
        return self.worker

    def _up(self, worker: socket.socket, broker: Sealed) -> None:
        try:
            while (frame := wire.recv_frame(worker)) is not None:
                if frame.header["type"] in protocol.RELAY_ONLY:
                    frame.header["type"] = "forged " + frame.header["type"]
                self._to_broker(broker, frame)
        except wire.WireError as err:
            with contextlib.suppress(OSError):
                self._to_broker(broker, Frame({"type": protocol.BROKEN, "error": str(err)}))
            self._kill()
        except OSError:
            pass

    def _down(self, broker: Sealed, worker: socket.socket) -> None:
        with contextlib.suppress(OSError, wire.WireError):
            while (frame := wire.recv_frame(broker)) is not None:
                wire.send_frame(worker, frame)
        self._kill()  # the broker is gone: so is the job

    def _to_broker(self, broker: Sealed, frame: Frame) -> None:
        with self._send_lock:
            wire.send_frame(broker, frame)

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.child.send_signal(signal.SIGKILL)
