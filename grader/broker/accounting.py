"""Where a rank's time goes during a call, from the kernel's accounting alone.

Every moment of a timed call, from its start until every rank has returned, is its rank's
own time, except while a complete request of its own is with the broker: from the moment a
frame of the rank's has arrived whole (a half-sent frame is the rank's doing) until the
broker lets it run again, from the moment the write that woke it began (after a frame that
waits on nothing, at once, or once what is being written to it is; after its result, at the
call's end) (:mod:`grader.broker.connections`). The kernel knows, for every thread of the rank's
process, how long it ran on a CPU and how long it was runnable but waited for one
(``/proc/<pid>/task/<tid>/schedstat``: nanoseconds on a CPU, nanoseconds in
the run queue), and the process's CPU clock counts every thread it ever had,
those that ended included (``clock_getcpuclockid``). The pid is that of the process that
speaks on the socket, as the kernel says (``SCM_CREDENTIALS``), never what the rank says.
So, over a call:

- ``cpu``: every thread's time on a CPU, the rank's own work wherever it falls, while it
  waits on the broker, after it returned while the call goes on;
- ``waiting``: time runnable but not running, the machine's load;
- ``outside``: time the rank's own that it neither ran nor waited for a CPU: a sleep, or a
  wait on something outside the broker. The same time while it waits on the broker is
  excused, never counted; a stretch's CPU never covers another stretch's outside time: the
  broker reads the figures where each stretch begins and ends (the end of a wait on another
  rank just before the write that ends it; where that answer is queued for the rank's writer
  thread, before it is queued, so that CPU run while it is written can still cover that
  long of a later sleep).

Each frame's arrival also ends a :class:`Gap`: the rank's CPU time since the previous
frame arrived, and its outside time since then, with how many of the rank's events and
waits the broker had recorded then, so that the judges can put each gap before the
operation it delayed (:meth:`grader.broker.traffic.Traffic.local_work`); the call's end
ends the last one, after the rank's last operation.

Nothing a rank says enters these figures. Where they cannot be read (another
node's rank, reached through a relay; a system without ``schedstat``), the
call's :class:`LocalTime` says it was not measured.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field

_UCRED = struct.Struct("3i")  # pid, uid, gid


@dataclass(frozen=True)
class Reading:
    """The kernel's account of one process at one moment (``at``: the monotonic clock)."""

    at: float
    cpu: float  # seconds on a CPU, every thread together
    waiting: float  # seconds runnable but waiting for a CPU


def sender_pid(sock: socket.socket) -> int | None:
    """The pid of the process that wrote the first bytes waiting on a Unix socket, as the
    kernel says (``SCM_CREDENTIALS``: the socket, or the listener it was accepted from, has
    ``SO_PASSCRED``; a process may name no pid but its own). Waits for those bytes; None
    when the connection ends first. The process that connected may be another: a rank's
    wrapper connects it, and the rank speaks."""
    if sys.platform != "linux" or sock.family != socket.AF_UNIX:
        return None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        _, ancillary, _, _ = sock.recvmsg(1, socket.CMSG_SPACE(_UCRED.size), socket.MSG_PEEK)
    except OSError:
        return None
    for level, kind, data in ancillary:
        if (level, kind) == (socket.SOL_SOCKET, socket.SCM_CREDENTIALS):
            pid = _UCRED.unpack(data[: _UCRED.size])[0]
            return pid if pid > 0 else None
    return None


_CPUCLOCK_SCHED = 2  # the kernel's encoding of a process's CPU clock: (~pid << 3) | 2
#: Threads of a rank whose ``schedstat`` stays open; any more are opened at each reading, so
#: that a rank starting hundreds of threads cannot use up the grader's descriptors.
KEPT_OPEN = 16


class Meter:
    """Reads one process's account from the kernel, cheaply enough for every frame it sends in a
    timed call (some 10 µs a reading; calls that are not timed read none).

    ``cpu`` is the process's CPU clock: every thread's time on a CPU, those that ended
    included, in one system call. ``waiting`` sums the run-queue time of its live threads
    from files kept open (for :data:`KEPT_OPEN` of them); the threads are listed again
    whenever their number changes (the ``task`` folder's link count is two more than it, one
    ``fstat``). A thread missed in
    between only loses its waiting, which then counts as outside time: a rank can be
    charged more that way, never less.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._clock = (~pid << 3) | _CPUCLOCK_SCHED
        self._lock = threading.Lock()  # its own reader thread and the call's start both read
        self._task = _open(f"/proc/{pid}/task")
        self._threads: dict[str, int] = {}  # tid: its open schedstat, or -1 (opened each time)
        self._count = -1

    def read(self) -> Reading | None:
        """The process's figures now; None once it cannot be read (it ended)."""
        with self._lock:
            at = time.monotonic()
            try:
                cpu = time.clock_gettime(self._clock)
                waiting = self._waiting()
            except OSError:  # it ended, or the meter was closed
                return None
            return Reading(at, cpu, waiting)

    def _waiting(self) -> float:
        if self._task < 0:
            raise OSError("no /proc entry")
        if os.fstat(self._task).st_nlink - 2 != self._count:
            self._list_threads()
        total = 0
        for tid, fd in list(self._threads.items()):
            try:
                total += int(self._schedstat(tid, fd).split()[1])
            except (OSError, IndexError, ValueError):  # it ended: list them again next time
                _close(self._threads.pop(tid))
                self._count = -1
        return total / 1e9

    def _schedstat(self, tid: str, fd: int) -> bytes:
        if fd >= 0:
            return os.pread(fd, 128, 0)
        fd = os.open(f"/proc/{self.pid}/task/{tid}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.read(fd, 128)
        finally:
            os.close(fd)

    def _list_threads(self) -> None:
        tids = set(os.listdir(f"/proc/{self.pid}/task"))
        for tid in set(self._threads) - tids:
            _close(self._threads.pop(tid))
        kept = sum(fd >= 0 for fd in self._threads.values())
        for tid in sorted(tids - set(self._threads)):
            if kept < KEPT_OPEN:
                self._threads[tid] = _open(f"/proc/{self.pid}/task/{tid}/schedstat")
                kept += self._threads[tid] >= 0
            else:
                self._threads[tid] = -1
        self._count = len(tids)

    def close(self) -> None:
        with self._lock:
            for fd in [self._task, *self._threads.values()]:
                _close(fd)
            self._task, self._threads = -1, {}


def _open(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1


def _close(fd: int) -> None:
    if fd >= 0:
        os.close(fd)


@dataclass(frozen=True)
class Gap:
    """A rank's local time up to the arrival of one of its frames (or the call's end): ``cpu``
    seconds on a CPU since the previous one arrived (or its call started), ``outside``
    seconds its own but neither on a CPU nor waiting for one; ``records``: (events, waits) the
    broker held of the rank by then."""

    records: tuple[int, int]
    cpu: float
    outside: float


@dataclass
class LocalTime:
    """One rank's local time in one call, accumulated from :class:`Reading` s.

    The call's time runs from its start (:meth:`released` first) to its end (:meth:`ended`),
    cut at each reading into stretches: the rank is *free* (its own time), or *waiting* on the
    broker, from the moment a frame of its own arrived whole (:meth:`arrived`) until the
    broker lets it run again (:meth:`released`). Every stretch's CPU counts; the time neither
    on a CPU nor in the run queue counts as ``outside`` in a free stretch, and is excused
    (``excused``) in a waiting one.
    """

    first: Reading | None = None
    last: Reading | None = None
    with_broker: bool = False  # since ``last``
    outside: float = 0.0
    excused: float = 0.0
    measured: bool = True
    over: bool = False  # :meth:`ended`
    gaps: list[Gap] = field(default_factory=list)
    since: Reading | None = None  # where the next gap's CPU time is counted from
    _outside_since: float = 0.0  # outside time since ``since``

    @classmethod
    def unmeasured(cls) -> LocalTime:
        return cls(measured=False)

    def arrived(self, reading: Reading | None, records: tuple[int, int] = (0, 0)) -> None:
        """A frame of the rank's arrived whole, with ``records`` (events, waits) of the rank on
        record: a gap ends, and the rank waits on the broker until :meth:`released`."""
        if self._advance(reading):
            self._gap(records)
            self.with_broker = True

    def released(self, reading: Reading | None, at: float | None = None) -> None:
        """The rank is free from ``at`` (default: the reading's moment) on, with the CPU and
        run-queue figures of ``reading``, read before the write that woke it: its frame is
        handled, or its wait answered. The first release starts the call."""
        if reading is not None and at is not None:
            reading = Reading(at, reading.cpu, reading.waiting)
        if self._advance(reading):
            self.with_broker = False

    def ended(self, reading: Reading | None, records: tuple[int, int]) -> None:
        """The call is over for every rank: the last gap ends (what the rank ran after its
        result, while the call went on, is its own)."""
        if self.first is not None and not self.over and self._advance(reading):
            self._gap(records)
            self.over = True

    def _advance(self, reading: Reading | None) -> bool:
        """Count the stretch from the latest reading to ``reading``; False where there is none."""
        if reading is None:
            self.measured = False
            return False
        if self.over:
            return False
        last = self.last
        if last is None:
            self.first = self.since = self.last = reading
            return True
        # Never backwards: a figure read before the latest one adds nothing.
        now = Reading(max(reading.at, last.at), max(reading.cpu, last.cpu),
                      max(reading.waiting, last.waiting))  # fmt: skip
        idle = max(0.0, (now.at - last.at) - (now.cpu - last.cpu) - (now.waiting - last.waiting))
        if self.with_broker:
            self.excused += idle
        else:
            self.outside += idle
            self._outside_since += idle
        self.last = now
        return True

    def _gap(self, records: tuple[int, int]) -> None:
        assert self.since is not None and self.last is not None
        self.gaps.append(Gap(records, self.last.cpu - self.since.cpu, self._outside_since))
        self.since, self._outside_since = self.last, 0.0

    @property
    def cpu(self) -> float:
        return self.last.cpu - self.first.cpu if self.first and self.last else 0.0

    @property
    def waiting(self) -> float:
        return self.last.waiting - self.first.waiting if self.first and self.last else 0.0
