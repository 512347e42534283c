"""What a killed job leaves behind is the grader's to end.

Killing a job ends torchrun and each rank's wrapper at once; what they started dies with its
parent (``PR_SET_PDEATHSIG``, set before each exec). One moment escapes that: bubblewrap's
child, the sandbox's first process, waits on an eventfd for its parent to finish the
namespaces, and an eventfd has no end of file. A bwrap killed in that moment leaves its child
blocked there for good, a process (root's, for a grader run as root) that init inherits
(seen with bubblewrap 0.8: once in about 130 SIGTERMs sent to a grader while its first job's
ranks were starting).

So a command of ``grader`` makes itself the subreaper of everything it starts
(:func:`adopt`, ``PR_SET_CHILD_SUBREAPER``): an orphan below it becomes its child instead of
init's. :func:`end` kills and reaps every child of its that it did not start as its own
(:func:`start`: each job's torchrun, each of a batch's graders, the sandbox's probe): after
each job it kills, and before it exits. No :func:`end` looks for orphans while :func:`start`
starts a child: between its fork and Popen's return, a child in a session of its own is
not yet known for the grader's own (tried: a probe beside other jobs' ends, registered once
Popen returned, was killed for an orphan in 2 runs of 5). Only children in another session
than the grader's are taken for orphans: a helper that a library starts in the grader's own
session is left alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from grader.sandbox import die_with

_PR_SET_CHILD_SUBREAPER = 36
_lock = threading.Lock()
_adopting = False  # this process is a subreaper: its orphans are its to end
_ours: dict[int, subprocess.Popen] = {}  # what it started itself, by pid
_stuck: set[int] = set()  # orphans SIGKILLed that did not die within an end()'s timeout


def adopt() -> None:
    """From now on, what this process starts and is orphaned becomes its child (Linux; a
    no-op elsewhere, where the orphans go to init as before)."""
    global _adopting
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0:
        _adopting = True


def start(command: list[str], **popen: Any) -> subprocess.Popen:
    """``subprocess.Popen(command, **popen)``: a child of this process's own, never an orphan
    to end."""
    with _lock:
        process = subprocess.Popen(command, **popen)
        _ours[process.pid] = process
    return process


def start_trusted(command: list[str], log: Path, **popen: Any) -> subprocess.Popen:
    """:func:`start` for a trusted process of a job (torchrun, a zygote): in a session of its
    own, to be ended whole; killed when this process dies; its files its user's alone; its
    output (stdout and stderr) into the file ``log``."""
    with open(log, "wb") as output:
        return start(
            command,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=functools.partial(_private_child, os.getpid()),
            **popen,
        )


def _private_child(parent: int) -> None:
    """Before the exec: every file it makes is its user's alone, and it dies with ``parent``."""
    os.umask(0o077)
    die_with(parent)


def end(timeout: float = 5.0) -> list[int]:
    """Kill and reap every orphan this process adopted, and those that their deaths hand
    over in turn (an orphaned bwrap's child), each waited for until ``timeout`` seconds from
    now at most; the pids ended."""
    if not _adopting:
        return []
    deadline = time.monotonic() + timeout
    ended: list[int] = []
    while time.monotonic() < deadline and (
        orphans := [pid for pid in _orphans() if pid not in ended and pid not in _stuck]
    ):
        for pid in orphans:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for pid in orphans:  # once one is dead, its own children are this process's
            if not _reaped(pid, deadline):
                _stuck.add(pid)  # not waited for again (a process in uninterruptible sleep)
        ended += orphans
    return ended


def _reaped(pid: int, deadline: float) -> bool:
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return True
        except ChildProcessError:
            return True
        time.sleep(0.001)
    return False


def _orphans() -> list[int]:
    """This process's children that it did not start, in another session than its own."""
    me, session = os.getpid(), os.getsid(0)
    with _lock:  # no child of our own is starting meanwhile
        for pid in [p for p, process in _ours.items() if process.returncode is not None]:
            del _ours[pid]  # reaped: the pid may be anyone's by now
        return [
            pid
            for pid, parent, sid in processes()
            if parent == me and pid not in _ours and sid != session
        ]


def processes() -> list[tuple[int, int, int]]:
    """(pid, parent, session) of every process in /proc: the one reading of the process
    tree (:func:`grader.launch.job.descendants` too)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()  # state, ppid, pgrp, session...
            found.append((int(entry), int(fields[1]), int(fields[3])))
        except (OSError, IndexError, ValueError):
            continue
    return found
