"""The broker's accounting of a rank's local time: from the kernel, never from the rank."""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest

from grader.broker import accounting
from grader.broker.accounting import LocalTime, Reading

linux = pytest.mark.skipif(sys.platform != "linux", reason="/proc and SO_PEERCRED are Linux's")


def test_free_time_neither_on_a_cpu_nor_waiting_for_one_is_outside() -> None:
    local = LocalTime()
    local.released(Reading(at=10.0, cpu=1.0, waiting=0.5))
    # 100 ms free: 30 ms on a CPU, 20 ms in the run queue, so 50 ms elsewhere (a sleep).
    local.began(Reading(at=10.1, cpu=1.03, waiting=0.52))
    local.released(Reading(at=10.2, cpu=1.04, waiting=0.52))  # blocked on the broker meanwhile
    local.began(Reading(at=10.25, cpu=1.09, waiting=0.52))  # 50 ms free, all of it computing
    assert local.measured
    assert local.cpu == pytest.approx(0.09)
    assert local.waiting == pytest.approx(0.02)
    assert local.outside == pytest.approx(0.05)


def test_time_blocked_on_the_broker_is_not_outside() -> None:
    local = LocalTime()
    local.released(Reading(at=0.0, cpu=0.0, waiting=0.0))
    local.began(Reading(at=0.001, cpu=0.001, waiting=0.0))  # a blocking wait arrives
    local.began(Reading(at=5.0, cpu=0.001, waiting=0.0))  # no release in between: not free
    assert local.outside == pytest.approx(0.0)


def test_a_rank_that_cannot_be_read_is_not_measured() -> None:
    local = LocalTime()
    local.released(Reading(at=0.0, cpu=0.0, waiting=0.0))
    local.began(None)
    assert not local.measured
    assert not LocalTime.unmeasured().measured


@linux
def test_the_pid_is_the_kernels_and_the_reading_counts_every_thread() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        assert accounting.peer_pid(ours) == os.getpid()
    before = accounting.read(os.getpid())
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    after = accounting.read(os.getpid())
    assert before is not None and after is not None
    assert after.cpu - before.cpu >= 0.04
    assert accounting.read(2**22 + 1) is None  # no such process


@linux
def test_a_sleep_in_a_collective_is_told_as_time_outside_any_message(grade) -> None:
    slept = grade("coll_sleeps", "collectives", k="performance", world_sizes=(2,))
    test = slept.test("performance[all_reduce]", 2)
    local = test["extra_data"]["local_time"]
    assert all(rank["measured"] for rank in local)
    assert max(rank["outside_seconds"] for rank in local) >= 0.045
    assert "neither computing nor in a message" in test["output"]
    # Told, not judged yet: the messages are the reference's, so are the points.
    assert test["score"] == test["max_score"]
