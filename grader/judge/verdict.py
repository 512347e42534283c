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
    if all(r.outcome == protocol.PASSED for r in per_rank.values()):
        return Verdict(protocol.PASSED, "", extra, seconds)

    failing = {r: res for r, res in per_rank.items() if res.outcome != protocol.PASSED}
    causes = {r: res for r, res in failing.items() if not res.is_echo} or failing
    outcome = min((res.outcome for res in causes.values()), key=_PRIORITY.index)
    if outcome == protocol.TIMEOUT:
        message = _timeout_message(per_rank)
    else:
        message = _first_message(causes, outcome)
    return Verdict(outcome, message, extra, seconds)


def _first_message(causes: dict[int, RankResult], outcome: str) -> str:
    ranks = sorted(r for r, res in causes.items() if res.outcome == outcome)
    first = causes[ranks[0]].message
    same = [r for r in ranks[1:] if causes[r].message == first]
    also = f" (the same on rank{'s' if len(same) > 1 else ''} {_ranks(same)})" if same else ""
    return f"rank {ranks[0]}: {first}{also}"


def _timeout_message(per_rank: dict[int, RankResult]) -> str:
    """Say who waits for whom: a deadlock is a cycle of ranks each waiting for the next."""
    stuck = {r: res for r, res in per_rank.items() if res.outcome == protocol.TIMEOUT}
    waits = [
        f"rank {r} {res.message}" if res.message else f"rank {r} is stuck"
        for r, res in sorted(stuck.items())
    ]
    cycle = _wait_cycle({r: res.extra.get("waiting_for") for r, res in stuck.items()})
    if cycle:
        head = "deadlock: " + " while ".join(f"rank {r} {stuck[r].message}" for r in cycle)
        rest = [w for r, w in zip(sorted(stuck), waits) if r not in cycle]
        return head + ("; " + "; ".join(rest) if rest else "")
    done = [r for r, res in per_rank.items() if res.outcome not in (protocol.TIMEOUT,)]
    tail = f"; rank{'s' if len(done) > 1 else ''} {_ranks(done)} had left the test" if done else ""
    return "; ".join(waits) + tail


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
