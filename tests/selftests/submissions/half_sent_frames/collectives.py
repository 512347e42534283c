"""The reference, and what the attacks on the broker's accounting through half-sent frames
share (graded as ``half_sent_frames+<attack>``: ``coll_burns_in_result``,
``coll_burns_on_a_thread``, ``coll_sleeps_in_send``). The broker read a rank's clocks when a
frame began, and held the rank as waiting on it until the frame was handled: work or a
sleep between a frame's first bytes and its rest went uncharged (issue 46)."""

import threading
import time

from grader.rank import link
from reference.collectives import *  # noqa: F403


def _burn(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _on_a_thread(work, *args):
    worker = threading.Thread(target=work, args=args)
    worker.start()
    worker.join()


def _half_sent(kind, work):
    """The rank's next frame of ``kind`` goes out as its first 8 bytes, then ``work()`` runs,
    then the rest of the frame goes."""
    current = link.current()
    post = current.post

    def posting(posted, payloads=None, **header):
        if posted != kind:
            return post(posted, payloads, **header)
        del current.post
        real = current.sock
        current.sock = _Splitting(real, work)
        try:
            return post(posted, payloads, **header)
        finally:
            current.sock = real

    current.post = posting


class _Splitting:
    """The rank's socket, but its next ``sendall`` stops after 8 bytes for ``work()``."""

    def __init__(self, sock, work):
        self._sock, self._work = sock, work

    def sendall(self, data):
        if self._work is not None:
            work, self._work = self._work, None
            self._sock.sendall(data[:8])
            work()
            data = data[8:]
        self._sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self._sock, name)
