"""The reference's all-reduce, then 0.3 s of the rank's CPU before it returns: the messages
are the reference's, the local work is not. Honest about it: the twin of the attacks that
hide the same work in the frames (``coll_burns_in_result``, ``coll_burns_on_a_thread``)."""

import time

from reference.collectives import *  # noqa: F403

_reference_all_reduce = all_reduce  # noqa: F405


def all_reduce(tensor, group=None):
    _reference_all_reduce(tensor, group)
    _burn(0.3)


def _burn(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
