"""Which calls the broker times: only the performance tests' (``World.call(timed=True)``).

A reading of a rank's clocks costs the broker some 10 µs a frame, so other calls read none and
have no local work. A timed call is measured whatever the rank does at its edges: a frame it
began before the call, and finished in it, is read when it has arrived.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from runner import REPO, SUBMISSIONS

from grader import sandbox
from grader.broker import accounting
from grader.broker.traffic import RankWork
from grader.course.submission import stage
from grader.device import Device
from grader.launch.job import job_settings
from grader.launch.world import CallLimits, RankPool, World

linux = pytest.mark.skipif(sys.platform != "linux", reason="/proc and SO_PEERCRED are Linux's")


@linux
def test_only_a_timed_call_reads_the_ranks_clocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reading of a rank's clocks costs the broker some 10 µs a frame: a call that is not
    timed (all but the performance tests') reads none, and has no local work to judge."""
    reads: list[int] = []
    read = accounting.Meter.read
    monkeypatch.setattr(accounting.Meter, "read", lambda self: reads.append(1) or read(self))
    stage(REPO / "reference", tmp_path / "import")
    pool = RankPool(2, job_settings(tmp_path, sandbox.Level.NONE, Device.CPU))
    try:
        world = World(2, pool, CallLimits(timeout=60))
        args = [(torch.full((1000,), float(r)),) for r in range(2)]
        world.call("collectives.all_reduce", args)  # the job's start, and a first import
        reads.clear()
        untimed = world.call("collectives.all_reduce", args)
        assert reads == [] and untimed.traffic.local_work() is None
        timed = world.call("collectives.all_reduce", args, timed=True)
        assert reads and timed.traffic.local_work() is not None
    finally:
        pool.close()


@linux
@pytest.mark.parametrize("name", ["burn", "half_sent"])
def test_a_frame_begun_before_a_timed_call_leaves_it_measured(tmp_path: Path, name: str) -> None:
    """A rank that sends the first bytes of a frame before a timed call starts, and the rest
    once it runs, is measured all the same: its 0.3 s of CPU a call are charged."""
    stage(SUBMISSIONS / "accounting_attacks", tmp_path / "import")
    pool = RankPool(2, job_settings(tmp_path, sandbox.Level.NONE, Device.CPU))
    try:
        world = World(2, pool, CallLimits(timeout=60))
        world.call(f"collectives.{name}", [(0.0,)] * 2)  # untimed: no clock read
        for _ in range(2):
            out = world.call(f"collectives.{name}", [(0.3,)] * 2, keep_payloads=False, timed=True)
            work = out.traffic.local_work()
            assert work is not None, "the call went unmeasured"
            assert all(rank.cpu >= 0.25 for rank in work), [rank.cpu for rank in work]
    finally:
        pool.close()


@linux
def test_a_thread_that_works_after_its_rank_returned_is_charged_while_the_call_goes_on(
    tmp_path: Path,
) -> None:
    """Rank 0 returns at once and its thread computes 0.3 s while rank 1 is still in the call:
    that CPU is rank 0's, after its last operation (the broker read its clocks when its result
    arrived, and never again)."""
    work = _timed_twice(tmp_path, "returns_then_works", 0.3)
    assert work[0].cpu >= 0.25, work[0]
    assert work[0].tail >= 0.25, work[0]


@linux
def test_cpu_while_a_rank_waits_on_the_broker_never_covers_a_later_sleep(tmp_path: Path) -> None:
    """Rank 0's thread computes 0.3 s while rank 0 waits for a message, then rank 0 sleeps
    0.3 s: both are charged (the broker freed it with the figures it read before it, not
    those of its wait's beginning, and the thread's CPU hid the sleep)."""
    work = _timed_twice(tmp_path, "works_while_blocked", 0.3)
    assert work[0].cpu >= 0.25, work[0]
    assert work[0].outside >= 0.25, work[0]
    assert work[0].tail >= 0.5, work[0]  # after its wait, its last operation


def _timed_twice(tmp_path: Path, name: str, seconds: float) -> list[RankWork]:
    """Rank 0's and rank 1's local work in the second of two timed calls of
    ``accounting_attacks``' ``name``."""
    stage(SUBMISSIONS / "accounting_attacks", tmp_path / "import")
    pool = RankPool(2, job_settings(tmp_path, sandbox.Level.NONE, Device.CPU))
    try:
        world = World(2, pool, CallLimits(timeout=60))
        world.call(f"collectives.{name}", [(0.0,)] * 2)  # untimed: the job's start, the import
        for _ in range(2):
            out = world.call(f"collectives.{name}", [(seconds,)] * 2, timed=True)
            work = out.traffic.local_work()
            assert work is not None, "the call went unmeasured"
    finally:
        pool.close()
    return work


@linux
@pytest.mark.parametrize(
    ("hidden", "honest", "figure", "least"),
    [
        # 0.3 s of CPU between the result frame's first 8 bytes and the rest: 1.00x before
        ("half_sent_frames+coll_burns_in_result", "coll_burns", "cpu_seconds", 0.25),
        # the same, on a thread, while the main thread holds the frame half-sent
        ("half_sent_frames+coll_burns_on_a_thread", "coll_burns", "cpu_seconds", 0.25),
        # two 50 ms sleeps, each inside a half-sent send frame: 1.00x before
        ("half_sent_frames+coll_sleeps_in_send", "coll_sleeps", "outside_seconds", 0.07),
    ],
)
def test_local_work_hidden_in_a_half_sent_frame_costs_what_its_honest_twin_loses(
    grade, hidden: str, honest: str, figure: str, least: float
) -> None:
    """A rank's time is its own until its request has arrived whole, and after its result,
    while the call goes on: the work its honest twin is charged is charged to it too."""
    for name in (honest, hidden):
        graded = grade(name, "collectives", k="performance[all_reduce]", world_sizes=(2,))
        test = graded.test("performance[all_reduce]", 2)
        assert test["extra_data"]["messages_ratio"] == pytest.approx(1.0), name
        assert max(rank[figure] for rank in test["extra_data"]["local_time"]) >= least, name
        assert test["extra_data"]["local_ratio"] >= 3.0, name
        assert test["score"] == 0, name
        assert "your local work, timed on this machine" in test["output"]
