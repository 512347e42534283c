"""``coll_burns``'s 0.3 s of CPU, done after the first 8 bytes of the rank's result frame went
out and before the rest (on top of ``half_sent_frames``). The rank's time is its own until its
frame is whole, and after it too, as long as the call goes on."""

from grader import protocol
from reference.collectives import *  # noqa: F403

_reference_all_reduce = all_reduce  # noqa: F405


def all_reduce(tensor, group=None):
    _reference_all_reduce(tensor, group)
    _half_sent(protocol.RESULT, lambda: _burn(0.3))  # noqa: F405
