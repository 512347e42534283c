"""Information that reached a rank came through the broker: the check every result passes.

The broker is the only path between ranks it knows of; a channel nobody has
found yet (a lock on a shared file, a kernel object) would carry data past
it. Such a channel shows anyway: a rank whose result is right although the
broker handed it fewer bytes than the other ranks' data that result depends
on got them some other way. The inputs are drawn from a secret seed, so they
cannot be compressed or guessed; an honest algorithm, however clever, moves
at least those bytes to the rank (a ring, a tree, a direct exchange all do),
so the bound never fails an honest submission. ``docs/trust.md`` lists the
bound of every graded function.
"""

from __future__ import annotations

from grader import failures
from grader.judge.call import CallResult


def check_informed(out: CallResult, rank: int, needed: int, what: str) -> None:
    """Rank ``rank``'s correct result depends on ``needed`` bytes of other ranks' data: the
    broker must have handed it at least that many, or it used a channel outside the grader."""
    got = out.traffic.delivered[rank]
    if got < needed:
        raise failures.ForbiddenCall(
            f"rank {rank}: {what}: its result is right, but it received only {got} bytes "
            f"through torch.distributed, fewer than the {needed} bytes of other ranks' data "
            "it depends on: the data reached it through a channel outside torch.distributed "
            "(shared files, locks, kernel objects), which is not allowed"
        )
