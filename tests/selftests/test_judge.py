"""The judge alone: from what the ranks reported to one verdict (no jobs, fast)."""

from __future__ import annotations

from grader.judge.communication import figures, min_rounds
from grader.judge.projection import machines, project
from grader.judge.verdict import RankResult, judge


def waiting(call: str, peer: int, outcome: str = "timeout", gone: bool = False) -> RankResult:
    extra = {"waiting_for": peer, **({"peer_gone": True} if gone else {})}
    suffix = " when a peer closed the connection" if gone else ""
    return RankResult(outcome, f"waits in {call}{suffix}", extra)


def test_a_test_passes_only_if_every_rank_reported_a_pass():
    assert judge({0: RankResult("passed"), 1: RankResult("passed")}, 2).passed
    silent = judge({0: RankResult("passed")}, 2)
    assert not silent.passed
    assert silent.message == "rank 1: reported no result"


def test_the_root_cause_is_named_not_its_echoes():
    verdict = judge(
        {
            0: RankResult("failed", "reduce: element 0: expected 3, got 2"),
            1: waiting("recv from rank 0", 0, "error", gone=True),
            2: waiting("send to rank 1", 1),
        },
        3,
    )
    assert verdict.outcome == "failed"
    assert verdict.message == (
        "rank 0: reduce: element 0: expected 3, got 2; then ranks 1, 2 waited for it in vain"
    )


def test_a_cycle_of_sends_is_a_deadlock():
    verdict = judge(
        {0: waiting("send to rank 1", 1), 1: waiting("send to rank 0", 0, "error", gone=True)}, 2
    )
    assert verdict.outcome == "timeout"
    assert verdict.message == (
        "deadlock: rank 0 waits in send to rank 1 while rank 1 waits in send to rank 0"
    )


def test_a_send_and_a_receive_that_never_match_are_not_called_a_deadlock():
    verdict = judge({0: waiting("isend to rank 1", 1), 1: waiting("irecv from rank 0", 0)}, 2)
    assert verdict.message.startswith(
        "rank 0's send to rank 1 and rank 1's receive from rank 0 never matched"
    )


def test_crash_outranks_the_errors_it_causes():
    verdict = judge(
        {
            0: RankResult("crashed", "the process exited during the test"),
            1: waiting("recv from rank 0", 0, "error", gone=True),
        },
        2,
    )
    assert (verdict.outcome, verdict.message) == (
        "crashed",
        "rank 0: the process exited during the test",
    )


def ring_all_reduce(p: int, n: int) -> list[list[dict]]:
    events: list[list[dict]] = [[] for _ in range(p)]
    for _ in range(2 * (p - 1)):
        for r in range(p):
            events[r].append({"op": "send", "peer": (r + 1) % p, "nbytes": n // p, "tag": 0})
            events[r].append({"op": "recv", "peer": (r - 1) % p, "nbytes": n // p, "tag": 0})
    return events


def test_ring_all_reduce_meets_the_bandwidth_bound_in_2p_minus_2_rounds():
    result = figures(ring_all_reduce(4, 4_000_000))
    assert result.busiest_bytes == 2 * 3 / 4 * 4_000_000
    assert result.rounds == 6
    assert min_rounds(4) == 2


def test_linear_sends_from_one_rank_take_one_round_each():
    """One-port model: a root sending to p-1 ranks in turn needs p-1 rounds."""
    p = 4
    events = [[{"op": "send", "peer": r, "nbytes": 8, "tag": 0} for r in range(1, p)]]
    events += [[{"op": "recv", "peer": 0, "nbytes": 8, "tag": 0}] for _ in range(1, p)]
    assert figures(events).rounds == p - 1


def test_a_root_receiving_from_everyone_takes_one_round_per_message():
    """Receives are one per round too: a linear gather needs p-1 rounds, not one."""
    p = 4
    events = [[{"op": "recv", "peer": r, "nbytes": 8, "tag": 0} for r in range(1, p)]]
    events += [[{"op": "send", "peer": 0, "nbytes": 8, "tag": 0}] for _ in range(1, p)]
    assert figures(events).rounds == p - 1


def test_projection_charges_the_slow_links_more():
    by_name = {m.name: m for m in machines()}
    events = ring_all_reduce(4, 64_000_000)
    nvlink = project(events, by_name["nvlink-node"])
    ethernet = project(events, by_name["ethernet-cluster"])
    assert 0 < nvlink < ethernet
