"""From what every rank reported for a test to one verdict and one message for the student.

A test passes only if every rank reported that it passed. Otherwise the
verdict names the root cause, not its echoes: when rank 2 raises, its peers
fail a moment later with "connection closed by peer", and those are not what
the student should read first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grader import protocol

# Most telling first: what the student must fix before anything else.
_PRIORITY = (
    protocol.FORBIDDEN,
    protocol.CRASHED,
    protocol.TIMEOUT,
    protocol.ERROR,
    protocol.FAILED,
    protocol.NOT_RUN,
)


@dataclass
class RankResult:
    outcome: str
    message: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_echo(self) -> bool:
        """A failure caused by another rank's (a peer that went away)."""
        return bool(self.extra.get("peer_gone"))


@dataclass
class Verdict:
    outcome: str
    message: str
    extra: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.outcome == protocol.PASSED


def judge(results: dict[int, RankResult], world_size: int, seconds: float = 0.0) -> Verdict:
    """Combine the ranks' results (a rank absent from ``results`` reported nothing)."""
    per_rank = {
        r: results.get(r, RankResult(protocol.ERROR, "reported no result"))
        for r in range(world_size)
    }
    extra = dict(per_rank[0].extra)
    extra.pop("peer_gone", None)
    extra["rank_outcomes"] = [per_rank[r].outcome for r in range(world_size)]
    if any("per_rank" in res.extra for res in per_rank.values()):
        # What each rank observed of itself (its schedule, its messages), in rank order.
        extra["per_rank"] = [per_rank[r].extra.get("per_rank") for r in range(world_size)]
    if all(r.outcome == protocol.PASSED for r in per_rank.values()):
        return Verdict(protocol.PASSED, "", extra, seconds)

    failing = {r: res for r, res in per_rank.items() if res.outcome != protocol.PASSED}
    echoes, waited = _echoes(per_rank)
    causes = {r: res for r, res in failing.items() if r not in echoes} or failing
    outcome = min((res.outcome for res in causes.values()), key=_PRIORITY.index)
    if outcome == protocol.TIMEOUT:
        message = _timeout_message(per_rank)
    else:
        message = _first_message(causes, outcome)
        in_vain = sorted(r for r in waited if r in failing and r not in causes)
        if in_vain:
            plural = "s" if len(in_vain) > 1 else ""
            message += f"; then rank{plural} {_ranks(in_vain)} waited for it in vain"
    return Verdict(outcome, message, extra, seconds)


def _echoes(per_rank: dict[int, RankResult]) -> tuple[set[int], set[int]]:
    """The ranks whose failure only echoes another's, and among them those that waited in vain.

    A rank that failed its own checks leaves the test; whoever waits for it,
    directly or through a chain of waiting ranks, fails as a consequence. A
    peer that closed the connection is a consequence too.
    """
    left_failing = {
        r
        for r, res in per_rank.items()
        if res.outcome in (protocol.FAILED, protocol.ERROR, protocol.FORBIDDEN) and not res.is_echo
    }
    waited: set[int] = set()
    changed = True
    while changed:
        changed = False
        for r, res in per_rank.items():
            if r not in waited and res.extra.get("waiting_for") in left_failing | waited:
                waited.add(r)
                changed = True
    return waited | {r for r, res in per_rank.items() if res.is_echo}, waited


def _first_message(causes: dict[int, RankResult], outcome: str) -> str:
    ranks = sorted(r for r, res in causes.items() if res.outcome == outcome)
    first = causes[ranks[0]].message
    same = [r for r in ranks[1:] if causes[r].message == first]
    also = f" (the same on rank{'s' if len(same) > 1 else ''} {_ranks(same)})" if same else ""
    return f"rank {ranks[0]}: {first}{also}"


def _timeout_message(per_rank: dict[int, RankResult]) -> str:
    """Say who waits for whom: a deadlock is a cycle of ranks each waiting for the next.

    A rank whose wait ended because its peer gave up first still waited: it
    belongs in the cycle as much as the rank that timed out.
    """
    waiting = {
        r: res
        for r, res in per_rank.items()
        if res.outcome == protocol.TIMEOUT or res.extra.get("waiting_for") is not None
    }
    waits = {r: _wait_text(r, res) for r, res in sorted(waiting.items())}
    cycle = _wait_cycle({r: res.extra.get("waiting_for") for r, res in waiting.items()})
    if len(cycle) == 2 and _sends(waiting[cycle[0]]) != _sends(waiting[cycle[1]]):
        a, b = cycle if _sends(waiting[cycle[0]]) else cycle[::-1]
        return (
            f"rank {a}'s send to rank {b} and rank {b}'s receive from rank {a} never matched "
            f"(different sizes, or another message got in between): {waits[a]}; {waits[b]}"
        )
    if cycle:
        rest = [text for r, text in waits.items() if r not in cycle]
        return (
            "deadlock: "
            + " while ".join(waits[r] for r in cycle)
            + "".join(f"; {text}" for text in rest)
        )
    left = [r for r in per_rank if r not in waiting]
    tail = (
        f"; rank{'s' if len(left) > 1 else ''} {_ranks(left)} had finished the test" if left else ""
    )
    return "; ".join(waits.values()) + tail


def _sends(result: RankResult) -> bool:
    return result.message.startswith(("waits in send", "waits in isend"))


def _wait_text(rank: int, result: RankResult) -> str:
    text = result.message.removesuffix(" when a peer closed the connection")
    return f"rank {rank} {text}" if text else f"rank {rank} is stuck"


def _wait_cycle(waiting_for: dict[int, int | None]) -> list[int]:
    """The ranks of a cycle in the wait-for graph, starting from the lowest rank, or []."""
    for start in sorted(waiting_for):
        seen: list[int] = []
        rank: int | None = start
        while rank is not None and rank in waiting_for and rank not in seen:
            seen.append(rank)
            rank = waiting_for[rank]
        if rank is not None and rank in seen:
            cycle = seen[seen.index(rank) :]
            low = cycle.index(min(cycle))
            return cycle[low:] + cycle[:low]
    return []


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))
