"""Attacks on the broker's accounting of local time (``test_timed_calls.py``).

The broker reads a rank's clocks when each of its frames has arrived, in a timed call only.
A rank that could make a timed call's frames look as if they began before the call would go
unmeasured, and its slow local work with it; one that worked on a thread of its own while it
waited on the broker, or after it returned while the call went on, would hide that work if
only its main thread's moments were read.
"""

import threading
import time

import torch
import torch.distributed as dist

from grader import protocol, wire
from grader.rank import link


def burn(seconds):
    """Honest but slow: ``seconds`` of CPU, then one message from rank 0 to rank 1."""
    _spin(seconds)
    x = torch.ones(4)
    if dist.get_rank() == 0:
        dist.send(x, 1)
    else:
        dist.recv(x, 0)


def half_sent(seconds):
    """As :func:`burn`, but every result frame is followed at once by the first bytes of a
    harmless frame, whose rest goes only with the rank's first frame of the next call: that
    frame begins while the call before is still its rank's call."""
    current = link.current()
    if not getattr(current, "half_sending", False):
        current.half_sending, current.rest = True, None
        post = current.post

        def finish():
            if current.rest is not None:
                rest, current.rest = current.rest, None
                current.sock.sendall(rest)
                current._write_lock.release()

        def posting(kind, payloads=None, **header):
            finish()
            post(kind, payloads, **header)
            if kind == protocol.RESULT:
                data = wire.head_of(wire.Frame({"type": protocol.HELLO}))
                current._write_lock.acquire()
                current.sock.sendall(data[:8])
                current.rest = data[8:]

        current.post, current.finish = posting, finish
    current.finish()
    burn(seconds)


def returns_then_works(seconds):
    """Rank 0 returns at once, leaving a thread that computes ``seconds``; rank 1 returns only
    after six times that (room for a loaded machine): the call goes on while rank 0's thread
    works."""
    if dist.get_rank() == 0:
        threading.Thread(target=_spin, args=(seconds,), daemon=True).start()
    else:
        time.sleep(6 * seconds)


def works_while_blocked(seconds):
    """Rank 0 waits for rank 1's message while a thread of its own computes ``seconds``, then
    sleeps as long: rank 1 sends after four times that. The thread's CPU is charged, and so is
    the sleep, which that CPU must not cover."""
    x = torch.ones(4)
    if dist.get_rank() == 0:
        worker = threading.Thread(target=_spin, args=(seconds,))
        received = dist.irecv(x, 1)
        worker.start()
        received.wait()
        worker.join()
        time.sleep(seconds)
    else:
        time.sleep(4 * seconds)
        dist.send(x, 0)


def _spin(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
