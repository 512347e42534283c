"""The graders of a batch: ``--jobs`` workers, each grading its students one at a time.

A worker is a ``grader run`` of its own (:mod:`grader.commands.worker`), in a session of
its own: what it starts can be killed whole. It pays the grader's start-up once for all the
students it grades. A student that hangs, or a worker that ends in any other way than a
verdict (an error, a crash), costs that student's row: the worker is stopped and a fresh one
grades the next. One event queue: a thread per worker reads its answers and puts them there,
and its end when it exits; between events the loop sleeps until the oldest grading's
deadline (``--timeout``), and stops that worker then.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from grader.launch import orphans
from grader.launch.job import descendants

GRACE_SECONDS = 3  # how long a stopped grader gets to end its own jobs before SIGKILL
CLOSE_SECONDS = 60  # how long a worker with no more students gets to end them as usual


@dataclass(frozen=True)
class Student:
    """What a worker needs to grade one student: where the files are and where results go."""

    name: str
    submission: Path
    results: Path
    log: Path


class Worker:
    """One ``grader run --batch-worker``: it grades the students it is sent, one at a time."""

    def __init__(self, command: list[str], log: Path, events: queue.Queue) -> None:
        """Start it; its start-up says what it says into ``log`` (its first student's)."""
        read_end, write_end = os.pipe()
        try:
            with open(log, "ab") as output:
                self.process = orphans.start(  # its own child: never taken for an orphan
                    [*command, "--batch-worker", str(write_end)],
                    stdin=subprocess.PIPE,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    pass_fds=(write_end,),
                    env={**os.environ, "NO_COLOR": "1", "COLUMNS": "120"},
                    start_new_session=True,
                )
        finally:
            os.close(write_end)
        threading.Thread(target=self._answers, args=(read_end, events), daemon=True).start()

    def grade(self, student: Student) -> None:
        request = {"submission": str(student.submission), "results": str(student.results)}
        request["log"] = str(student.log)
        assert self.process.stdin is not None
        with contextlib.suppress(OSError):  # it ended: its end is the student's, as events say
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()

    def _answers(self, read_end: int, events: queue.Queue) -> None:
        """Each answer's status, then None once the worker has exited."""
        with os.fdopen(read_end, "rb") as answers:
            for line in answers:
                events.put((self, json.loads(line)["status"]))
        self.process.wait()
        events.put((self, None))


@dataclass
class _Running:
    student: Student
    worker: Worker
    started: float = field(default_factory=time.monotonic)


#: What the batch does with a student's end: (student, seconds, exit status, timed out).
Finish = Callable[[Student, float, int, bool], None]


def grade_all(
    command: list[str], todo: list[Student], jobs: int, timeout: float, finish: Finish
) -> None:
    """Keep ``jobs`` students graded at a time until none is left; stop every worker if
    interrupted. ``command``: ``grader run`` and its selection, for every worker."""
    pending, running, idle = list(todo), list[_Running](), list[Worker]()
    events: queue.Queue = queue.Queue()
    workers: list[Worker] = []
    try:
        while pending or running:
            while pending and len(running) < jobs:
                student = pending.pop(0)
                student.log.write_bytes(b"")
                if not idle:
                    workers.append(Worker(command, student.log, events))
                    idle.append(workers[-1])
                running.append(_Running(student, idle.pop()))
                running[-1].worker.grade(student)
            oldest = min(running, key=lambda r: r.started)
            left = max(0.0, oldest.started + timeout - time.monotonic())
            try:
                worker, status = events.get(timeout=left)
            except queue.Empty:
                running.remove(oldest)
                status = stop([oldest.worker.process])[0]
                orphans.end()  # what a grader stopped by SIGKILL left, handed to the batch
                finish(oldest.student, time.monotonic() - oldest.started, status, True)
                continue
            if status is None and worker in idle:  # ended between students
                idle.remove(worker)
            run = next((r for r in running if r.worker is worker), None)
            if run is None:  # a worker that ended after its last answer, or was stopped
                continue
            running.remove(run)
            if status is None:  # it exited before it answered
                status = worker.process.wait()
                orphans.end()
            elif status in (0, 1):
                idle.append(worker)
            finish(run.student, time.monotonic() - run.started, status, False)
    except BaseException:
        stop([w.process for w in workers])
        raise
    _close(workers)


def _close(workers: list[Worker]) -> None:
    """No more students: each worker ends at the end of its input, closing its jobs."""
    for worker in workers:
        with contextlib.suppress(OSError, ValueError):
            assert worker.process.stdin is not None
            worker.process.stdin.close()
    deadline = time.monotonic() + CLOSE_SECONDS
    for worker in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
    stop([w.process for w in workers if w.process.poll() is None])


def stop(processes: list[subprocess.Popen]) -> list[int]:
    """SIGTERM (a grader stops its own jobs, as on Ctrl-C), then SIGKILL all that is left.

    All are signalled first, so that stopping many takes one grace period, not many.
    """
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        if process.poll() is None:
            for pid in [*descendants(process.pid), process.pid]:  # workers: own sessions
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
    return [process.wait() for process in processes]


def worker_command(grader_args: list[str], run_args: list[str]) -> list[str]:
    """The command every worker of a batch runs (its selection passed through)."""
    return [sys.executable, "-m", "grader", *grader_args, "run", *run_args]
