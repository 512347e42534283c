"""The broker's accounting of a rank's local time: from the kernel, never from the rank."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from grader import protocol, wire
from grader.broker import accounting
from grader.broker.accounting import Gap, LocalTime, Reading
from grader.broker.server import Broker
from grader.broker.traffic import Event, Message, RankWork, Traffic, Wait
from grader.judge.projection import LOCAL_WORK, project
from grader.protocol import OpName
from grader.testkit.costs import NO_REFERENCE, Timed, judge_performance, local_ratio

linux = pytest.mark.skipif(sys.platform != "linux", reason="/proc and SO_PEERCRED are Linux's")


def test_free_time_neither_on_a_cpu_nor_waiting_for_one_is_outside() -> None:
    local = LocalTime()
    local.released(Reading(at=10.0, cpu=1.0, waiting=0.5))
    # 100 ms free: 30 ms on a CPU, 20 ms in the run queue, so 50 ms elsewhere (a sleep).
    local.arrived(Reading(at=10.1, cpu=1.03, waiting=0.52))
    local.released(Reading(at=10.2, cpu=1.04, waiting=0.52))  # blocked on the broker meanwhile
    local.arrived(Reading(at=10.25, cpu=1.09, waiting=0.52))  # 50 ms free, all of it computing
    assert local.measured
    assert local.cpu == pytest.approx(0.09)
    assert local.waiting == pytest.approx(0.02)
    assert local.outside == pytest.approx(0.05)


def test_time_blocked_on_the_broker_is_not_outside() -> None:
    local = LocalTime()
    local.released(Reading(at=0.0, cpu=0.0, waiting=0.0))
    local.arrived(Reading(at=0.001, cpu=0.001, waiting=0.0))  # a blocking wait arrives
    local.arrived(Reading(at=5.0, cpu=0.001, waiting=0.0))  # no release in between: not free
    assert local.outside == pytest.approx(0.0)


def test_after_its_result_a_rank_is_charged_its_cpu_until_the_call_ends_and_no_more() -> None:
    local = LocalTime()
    local.released(Reading(at=0.0, cpu=0.0, waiting=0.0))
    local.arrived(Reading(at=0.01, cpu=0.01, waiting=0.0), (2, 1))  # its result, whole
    # The call goes on 0.49 s (another rank still works): 0.3 s of it on a CPU (a thread).
    local.ended(Reading(at=0.5, cpu=0.31, waiting=0.0), (2, 1))
    assert local.cpu == pytest.approx(0.31)
    assert local.gaps[-1] == Gap((2, 1), pytest.approx(0.3), 0.0)  # after its last operation
    assert local.outside == pytest.approx(0.0) and local.excused == pytest.approx(0.19)
    local.ended(Reading(at=1.0, cpu=0.5, waiting=0.0), (2, 1))  # over: nothing more counts
    assert local.cpu == pytest.approx(0.31) and len(local.gaps) == 2


def test_a_rank_that_cannot_be_read_is_not_measured() -> None:
    local = LocalTime()
    local.released(Reading(at=0.0, cpu=0.0, waiting=0.0))
    local.arrived(None)
    assert not local.measured
    assert not LocalTime.unmeasured().measured


@linux
def test_the_pid_is_the_kernels_and_the_reading_counts_every_thread() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        theirs.sendall(b"hello")
        assert accounting.sender_pid(ours) == os.getpid()
        assert ours.recv(5) == b"hello"  # only looked at
    meter = accounting.Meter(os.getpid())
    try:
        before = meter.read()
        end = time.process_time() + 0.05
        while time.process_time() < end:
            pass
        after = meter.read()
    finally:
        meter.close()
    assert before is not None and after is not None
    assert after.cpu - before.cpu >= 0.04
    assert accounting.Meter(2**22 + 1).read() is None  # no such process


class _RunsLateAfterWriting(socket.socket):
    """The broker's end of a rank's socket, whose thread gets no CPU for a while after each
    write, as on a busy machine: the write wakes the rank, which may run first."""

    def send(self, data, flags: int = 0) -> int:  # type: ignore[no-untyped-def]
        sent = super().send(data, flags)
        time.sleep(0.04)
        return sent


@linux
@pytest.mark.parametrize("payload", [0, 4 << 20], ids=["written-at-once", "by-its-writer"])
def test_a_rank_is_free_from_the_write_that_woke_it_however_late_the_broker_runs(payload) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # as launch.job.listen's are
    late = _RunsLateAfterWriting(socket.AF_UNIX, socket.SOCK_STREAM, fileno=ours.detach())
    broker = Broker(1)
    served = threading.Thread(target=broker.serve, args=(0, late), daemon=True)
    served.start()

    def rank() -> None:  # sleeps 50 ms as soon as it has its call
        with theirs:
            wire.send_frame(theirs, wire.Frame({"type": protocol.HELLO, "rank": 0}))
            assert wire.recv_frame(theirs) is not None  # the segment it was offered: not taken
            assert wire.recv_frame(theirs) is not None  # the call
            time.sleep(0.05)
            wire.send_frame(theirs, wire.Frame({"type": protocol.MARK, "label": "slept"}))

    sleeper = threading.Thread(target=rank, daemon=True)
    sleeper.start()
    try:
        assert broker.wait_connected(time.monotonic() + 10)
        call = wire.Frame({"type": protocol.CALL}, [bytes(payload)] if payload else [])
        broker.start_call([call], forbid_collectives=False, timed=True)
        sleeper.join(10)
        served.join(10)
        local = broker.traffic.local[0]
    finally:
        broker.close()
    assert local.measured
    # Free from the write, not 40 ms after it: the whole sleep lies in the free stretch, and
    # what of it this process (the rank here) did not run is outside time.
    assert local.last is not None and local.first is not None
    assert local.last.at - local.first.at >= 0.05
    assert local.outside >= 0.05 - local.cpu - local.waiting


_COMPUTES_DURING_A_WRITE = r"""
import socket, sys, threading, time
from grader import protocol, wire

rank = socket.socket(socket.AF_UNIX)
rank.connect(sys.argv[1])
wire.send_frame(rank, wire.Frame({"type": protocol.HELLO, "rank": 0}))  # up
print("ready", flush=True)

def read():  # late: the broker's writer is still writing the call after the first mark
    time.sleep(0.1)
    while wire.recv_frame(rank, 1 << 31).header["type"] != protocol.CALL:
        pass

threading.Thread(target=read, daemon=True).start()
time.sleep(0.1)
wire.send_frame(rank, wire.Frame({"type": protocol.MARK, "label": "1"}))  # waits on nothing
end = time.thread_time() + 0.3
while time.thread_time() < end:  # computing: never outside time
    pass
wire.send_frame(rank, wire.Frame({"type": protocol.MARK, "label": "2"}))
rank.recv(1)
"""


@linux
def test_a_rank_computing_while_a_frame_is_written_to_it_is_never_outside(tmp_path) -> None:
    """A release asked for while a big frame was being written is never dated back to when
    that write began: the rank that computes meanwhile is charged its CPU, not a sleep."""
    path = str(tmp_path / "rank.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # as launch.job.listen does
    listener.bind(path)
    listener.listen(1)
    broker = Broker(1)
    broker.accept_on([listener])
    child = subprocess.Popen(
        [sys.executable, "-c", _COMPUTES_DURING_A_WRITE, path], stdout=subprocess.PIPE
    )
    try:
        assert broker.wait_connected(time.monotonic() + 30)
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        call = wire.Frame({"type": protocol.CALL}, [bytes(64 << 20)])  # never in the segment
        broker.start_call([call], forbid_collectives=False, timed=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(broker.traffic.local[0].gaps) < 2:
            time.sleep(0.01)
        local = broker.traffic.local[0]
    finally:
        broker.close()
        child.kill()
        child.wait()
    assert len(local.gaps) >= 2
    computing = local.gaps[1]  # the gap that ends with the second mark
    assert computing.cpu >= 0.25
    assert computing.outside < 0.03  # it was 0.144 s, from the call's write on


@linux
def test_a_sleep_in_a_collective_costs_its_performance_points(grade) -> None:
    slept = grade("coll_sleeps", "collectives", k="performance[all_reduce]", world_sizes=(2,))
    test = slept.test("performance[all_reduce]", 2)
    local = test["extra_data"]["local_time"]
    assert max(rank["outside_seconds"] for rank in local) >= 0.095  # two steps of the ring
    assert test["extra_data"]["messages_ratio"] == pytest.approx(1.0)  # the reference's
    assert test["extra_data"]["local_ratio"] >= 3.0
    assert test["score"] == 0
    # Where the time went, at the line of the operation the sleep delayed.
    output = test["output"]
    assert "neither computing nor in a message" in output
    assert re.search(r"\(\d+\.\d+ ms of it before the send at \S*collectives\.py:\d+", output)


@linux
def test_local_work_done_in_a_python_loop_costs_its_performance_points(grade) -> None:
    looped = grade("coll_python_loop", "collectives", k="performance[all_reduce]", world_sizes=(2,))
    test = looped.test("performance[all_reduce]", 2)
    assert test["extra_data"]["messages_ratio"] == pytest.approx(1.0)
    assert test["extra_data"]["local_ratio"] >= 3.0
    assert test["score"] == 0
    assert "your local work, timed on this machine" in test["output"]


@linux
def test_local_work_on_a_thread_that_ended_still_counts_as_computing(grade) -> None:
    threaded = grade("coll_thread_work", "collectives", k="performance[all_reduce]",
                     world_sizes=(2,))  # fmt: skip
    test = threaded.test("performance[all_reduce]", 2)
    # Two steps of the ring, 50 ms of CPU before each send, on threads that had ended.
    for rank in test["extra_data"]["local_time"]:
        assert rank["cpu_seconds"] >= 0.09
        assert rank["longest_cpu_seconds"] >= 0.045
        assert rank["longest_cpu_before"].startswith("before the send")
    assert test["extra_data"]["local_ratio"] >= 3.0
    assert test["score"] == 0
    assert "your local work, timed on this machine" in test["output"]


@linux
def test_work_in_a_child_process_is_refused_where_it_could_not_be_counted(grade) -> None:
    """A child's CPU is outside its rank's accounting: the sandbox refuses to start one."""
    forked = grade("coll_child_work", "collectives", k="all_reduce", world_sizes=(2,))
    assert forked.results["extra_data"]["sandbox"] != "none"
    tests = forked.results["tests"]
    assert tests and all(test["score"] == 0 for test in tests)
    correctness = forked.test("all_reduce", 2)
    assert correctness["extra_data"]["outcome"] == "forbidden"
    assert "PermissionError" in correctness["output"]
    refused = "the sandbox refuses this system call (sockets, new processes, file locks, "
    assert refused in correctness["output"]
    assert "subprocess.run(" in correctness["output"]  # the fork was refused, and then this


@linux
def test_a_meter_counts_threads_that_ended_and_threads_that_began() -> None:
    meter = accounting.Meter(os.getpid())
    try:
        before = meter.read()
        for _ in range(2):  # the second one starts after the meter listed the threads
            worker = threading.Thread(target=_spin, args=(0.05,))
            worker.start()
            worker.join()
            meter.read()
        after = meter.read()
    finally:
        meter.close()
    assert before is not None and after is not None
    assert after.cpu - before.cpu >= 0.09
    assert meter.read() is None  # closed: nothing more to read


@linux
def test_a_rank_with_hundreds_of_threads_costs_the_meter_a_bounded_number_of_descriptors() -> None:
    release = threading.Event()
    threads = [threading.Thread(target=release.wait) for _ in range(4 * accounting.KEPT_OPEN)]
    for thread in threads:
        thread.start()
    held = len(os.listdir("/proc/self/fd"))
    meter = accounting.Meter(os.getpid())
    try:
        assert meter.read() is not None
        assert len(os.listdir("/proc/self/fd")) <= held + 1 + accounting.KEPT_OPEN
        release.set()
        for thread in threads:
            thread.join()
        assert meter.read() is not None  # the ended threads are dropped, the rest still read
    finally:
        release.set()
        meter.close()
    assert len(os.listdir("/proc/self/fd")) == held


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@linux
def test_the_reference_keeps_its_performance_points_against_itself(grade) -> None:
    graded = grade("reference", "collectives", k="performance[all_reduce]", world_sizes=(2,))
    test = graded.test("performance[all_reduce]", 2)
    assert test["score"] == test["max_score"]
    assert 0.5 <= test["extra_data"]["local_ratio"] <= 1.5


def _timed(gaps: list[tuple[tuple[int, int], float, float]]) -> LocalTime:
    local = LocalTime()
    local.released(Reading(at=0.0, cpu=0.0, waiting=0.0))
    local.gaps = [Gap(records, cpu, outside) for records, cpu, outside in gaps]
    return local


def test_local_work_lies_before_the_operation_it_delayed_and_replays_on_free_links() -> None:
    traffic = Traffic.empty(2)
    # Rank 0: a mark, a send to 1, a receive from 1, and a wait for that receive.
    traffic.per_rank[0] += [
        Event("mark", -1, 0, at="step"),
        Event("send", 1, 8, at="c.py:1"),
        Event("recv", 1, 8, at="c.py:2"),
    ]
    traffic.waits[0].append(Wait(after=3, of=2))
    # Rank 1: a receive from 0, a wait for it, then a send back.
    traffic.per_rank[1] += [Event("recv", 0, 8, at="c.py:5"), Event("send", 0, 8, at="c.py:6")]
    traffic.waits[1].append(Wait(after=1, of=0))
    traffic.local = [
        # (events, waits) on record when the gap ended: 1 s computing before the mark (so
        # before the send), 2 s asleep before the receive, 0.5 s before the wait, 0.25 s
        # before it returned.
        _timed([((0, 0), 1.0, 0.0), ((2, 0), 0.0, 2.0), ((3, 0), 0.5, 0.0), ((3, 1), 0.25, 0)]),
        # 0.1 s before its wait, 3 s computing before its send.
        _timed([((1, 0), 0.1, 0.0), ((1, 1), 3.0, 0.0)]),
    ]
    work = traffic.local_work()
    assert work is not None
    assert [e.op for e in traffic.messages()[0]] == [OpName.SEND, OpName.RECV, OpName.WAIT]
    assert work[0].before == (1.0, 2.0, 0.5) and work[0].tail == 0.25
    assert work[0].longest_outside == (2.0, "before the recv at c.py:2")
    assert [e.op for e in traffic.messages()[1]] == [OpName.RECV, OpName.WAIT, OpName.SEND]
    assert work[1].before == (0.0, 0.1, 3.0) and work[1].tail == 0.0
    assert work[1].longest_cpu == (3.0, "before the send at c.py:6")
    # Rank 1 can send only at 1 + 3 s; rank 0 waits for that until 4 s, then works 0.25 s.
    timed = Timed(traffic.messages(), work)
    assert timed.critical_path == pytest.approx(4.25)
    assert project(traffic.messages(), LOCAL_WORK) == 0.0  # the messages alone cost nothing


def test_a_call_with_a_rank_not_measured_has_no_local_work() -> None:
    traffic = Traffic.empty(2)
    traffic.local = [_timed([]), LocalTime.unmeasured()]
    assert traffic.local_work() is None
    assert Timed.of(traffic) is None


def test_the_busier_ratio_decides_and_unjudged_local_work_says_why() -> None:
    log = [
        [Message(OpName.SEND, 1, 8)],
        [Message(OpName.RECV, 0, 8), Message.wait(0)],
    ]

    def timed(seconds: float) -> Timed:
        idle = RankWork((0.0, 0.0), 0.0, 0.0, 0.0, 0.0, (0.0, ""), (0.0, ""))
        slept = RankWork((seconds,), 0.0, 0.0, seconds, 0.0, (0.0, ""), (seconds, "before x"))
        return Timed(log, [slept, idle])

    slow = judge_performance("all_reduce", 2, 8, log, log, 1.5, 3.0, timed(0.05), timed(0.01))
    assert slow.fraction == 0.0 and slow.details["local_ratio"] == pytest.approx(5.0)
    assert slow.message.splitlines()[1].startswith("  your local work, timed on this machine")
    assert "50.00 ms neither computing nor in a message" in slow.message
    assert "(50.00 ms of it before x)" in slow.message
    fair = judge_performance("all_reduce", 2, 8, log, log, 1.5, 3.0, timed(0.01), timed(0.01))
    assert fair.fraction == 1.0
    # Within the allowance over the reference's, a difference is noise: never charged.
    noisy = judge_performance(
        "all_reduce", 2, 8, log, log, 1.5, 3.0, timed(0.029), timed(0.01), allowance=0.02
    )
    assert noisy.fraction == 1.0 and noisy.details["local_ratio"] == 1.0
    assert local_ratio(timed(0.05), timed(0.01), 0.02) == pytest.approx(3.0)
    alone = judge_performance("all_reduce", 2, 8, log, log, 1.5, 3.0, timed(0.05), NO_REFERENCE)
    assert alone.fraction == 1.0 and alone.details["local_ratio"] is None
    assert f"local work not judged: {NO_REFERENCE}" in alone.message
