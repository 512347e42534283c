"""The reference's ring all-reduce, asleep for 50 ms in every step of its ring: the messages
are the reference's, the time is not. The broker's accounting sees each sleep as time the rank
spent neither computing nor in a message, before the send it delayed."""

import time

from reference.collectives import *  # noqa: F403

_reference_send_recv = _send_recv  # noqa: F405


def _send_recv(*args, **kwargs):
    time.sleep(0.05)
    return _reference_send_recv(*args, **kwargs)
