"""How the broker words a deadlock in which some rank has returned: fast, no job.

A rank that waits on a peer which returned waits for what the peer never posted: the
message says so at the wait, since the peer's missing send (or receive) is the bug.
"""

from __future__ import annotations

from grader.broker import faults
from grader.broker.ops import Op, RankState, Returned


def waiting(rank: int, kind: str, peer: int) -> RankState:
    state = RankState(rank, running=True)
    state.blocked_on = Op(rank, 1, kind, peer, 0, "assignments/pipeline_parallel.py:97 in _recv")
    return state


def returned(rank: int) -> RankState:
    return RankState(rank, outcome=Returned())


def test_a_wait_on_a_returned_rank_says_what_it_never_sent() -> None:
    message = faults.deadlock([waiting(0, "recv", 1), returned(1), returned(2)])
    assert message == (
        "deadlock: rank 0 waits in recv from rank 1 at assignments/pipeline_parallel.py:97 in "
        "_recv, but rank 1 returned without sending it (rank 2 returned)"
    )
    message = faults.deadlock([returned(0), waiting(1, "send", 0)])
    assert message is not None and message.endswith("but rank 0 returned without receiving it")


def test_ranks_waiting_on_each_other_name_the_returned_bystanders_once() -> None:
    message = faults.deadlock([waiting(0, "send", 1), waiting(1, "send", 0), returned(2)])
    assert message is not None and message.endswith("(rank 2 returned)")
    assert "returned without" not in message
    assert faults.deadlock([waiting(0, "recv", 1), RankState(1, running=True)]) is None
