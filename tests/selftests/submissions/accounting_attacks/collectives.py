"""Attacks on the broker's accounting of local time (``test_timed_calls.py``).

The broker reads a rank's clocks when each of its frames begins to arrive, in a timed call
only. A rank that could make a timed call's frames look as if they began before the call
would go unmeasured, and its slow local work with it.
"""

import time

import torch
import torch.distributed as dist

from grader import protocol, wire
from grader.rank import link


def burn(seconds):
    """Honest but slow: ``seconds`` of CPU, then one message from rank 0 to rank 1."""
    start = time.process_time()
    while time.process_time() - start < seconds:
        pass
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
