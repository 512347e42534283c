"""The reference's ring all-reduce, with 50 ms of work in every step of its ring done on a
thread of its own, which has ended before the rank's next message. The kernel's per-thread
figures lose a thread once it ends; the process's CPU clock, which the broker reads, keeps
its time: the rank was computing, not asleep."""

import threading
import time

from reference.collectives import *  # noqa: F403

_reference_send_recv = _send_recv  # noqa: F405


def _send_recv(*args, **kwargs):
    worker = threading.Thread(target=_work, args=(0.05,))
    worker.start()
    worker.join()
    return _reference_send_recv(*args, **kwargs)


def _work(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
