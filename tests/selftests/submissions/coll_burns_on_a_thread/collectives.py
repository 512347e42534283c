"""``coll_burns_in_result``, with the 0.3 s of CPU on a thread of its own while the main thread
holds the result frame half-sent (on top of ``half_sent_frames``): every thread's CPU is the
rank's, blocked or not."""

from grader import protocol
from reference.collectives import *  # noqa: F403

_reference_all_reduce = all_reduce  # noqa: F405


def all_reduce(tensor, group=None):
    _reference_all_reduce(tensor, group)
    _half_sent(protocol.RESULT, lambda: _on_a_thread(_burn, 0.3))  # noqa: F405
